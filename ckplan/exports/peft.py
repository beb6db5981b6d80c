"""A Python snippet for Hugging Face's Trainer with PEFT: `LoraConfig`, `BitsAndBytesConfig`
and `TrainingArguments` for the plan (docs/exports.md).

- PEFT's `LoraConfig` (peft v0.17.0, src/peft/tuners/lora/config.py): `r`, `lora_alpha`
  (default 8), `target_modules` (module names, or the shorthand "all-linear"), `lora_dropout`,
  `task_type="CAUSAL_LM"`, and `use_dora=True` for DoRA (peft v0.21.2).
- transformers' `BitsAndBytesConfig` (v4.56.0, src/transformers/utils/quantization_config.py):
  QLoRA's recipe (Dettmers et al. 2023) is `load_in_4bit=True`, `bnb_4bit_quant_type="nf4"`
  (or "fp4"), `bnb_4bit_use_double_quant=True` (ckplan's 4-bit weight bytes count the
  double-quantised statistics), `bnb_4bit_compute_dtype=torch.bfloat16`; int8 frozen weights
  are `load_in_8bit=True`.
- transformers' `TrainingArguments` (v4.56.0, src/transformers/training_args.py):
  `per_device_train_batch_size`, `gradient_accumulation_steps`, `gradient_checkpointing`
  (the model's `gradient_checkpointing_enable`, which checkpoints every decoder layer, one
  layer per checkpoint), `gradient_checkpointing_kwargs={"use_reentrant": False}` (True under
  `framework_version: "4.44"`, whose default ckplan then counts, or `checkpoint_reentrant:
  true`: `frameworks.checkpoint_reentrant`), `optim`
  (an `OptimizerNames` value: adamw_torch_fused, the Trainer's own default from torch 2.8,
  whose fused kernel updates in place, or `adamw_torch` under `optimizer_implementation:
  foreach`, the default of transformers v4.44, whose foreach step ckplan counts with its copy
  of exp_avg_sq; adamw_8bit, paged_adamw_8bit, adafactor, sgd,
  lion_32bit, adamw_anyprecision with `optim_args`), `bf16` / `fp16`, and `fsdp`
  ("shard_grad_op" for ZeRO-2, "full_shard" for ZeRO-3, with " offload" for FSDP's CPU
  offload, `param_offload: cpu`), with `fsdp_config` version the plan's `fsdp_version` (FSDP1
  or FSDP2, whose buffers ckplan counted; the Trainer's default is FSDP2 from transformers
  v5.10.1) and FSDP1's `backward_prefetch` of `fsdp_backward_prefetch` (an fp32 reduction,
  `fsdp_reduce_dtype: fp32` beside half-precision training, has no key there: refused). A
  4-bit model under FSDP gets a float `bnb_4bit_quant_storage` and loads in it
  (`sharded_qlora`).

The Trainer runs data parallelism only and recomputes every layer or none: other layer
segments, module recomputation, per-op policies, tp/pp/cp/ep > 1, the step in backward and
SGD with momentum (its `optim="sgd"` is torch.optim.SGD without momentum) are refused.
"""

from __future__ import annotations

from ckplan.exports.segments import LayerSegments, module_reason
from ckplan.model import frameworks
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan

NAME = "peft"
# ckplan's optimizer -> TrainingArguments.optim (transformers v4.56.0 OptimizerNames)
OPTIM = {
    "adamw": "adamw_torch_fused",
    "adamw-8bit": "adamw_8bit",
    "paged-adamw-8bit": "paged_adamw_8bit",
    "adafactor": "adafactor",
    "sgd-nomomentum": "sgd",
    "lion": "lion_32bit",
    "adamw-bf16": "adamw_anyprecision",
}
# torch.optim.AdamW with neither fused nor foreach, which PyTorch runs foreach on CUDA
# (`optimizer_implementation: foreach`; transformers v4.44.2's default optim)
FOREACH_ADAMW = "adamw_torch"
# Trainer parses optim_args "k=v,k=v" into AnyPrecisionAdamW's dtypes (use_kahan_summation off)
ANYPRECISION_ARGS = "momentum_dtype=bfloat16,variance_dtype=bfloat16"
# bitsandbytes' compute dtype of the 4-bit layers, the run's precision (BitsAndBytesConfig
# `bnb_4bit_compute_dtype`, transformers utils/quantization_config.py)
COMPUTE_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}
PEFT_LORA_ALPHA = 8  # LoraConfig's default lora_alpha (peft v0.17.0)
FSDP = {2: "shard_grad_op", 3: "full_shard"}


def reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """Why Hugging Face's Trainer cannot run this plan, or None."""
    if why := module_reason(layers, "Trainer"):
        return why
    if spec.kind != "transformer":
        return f"the Trainer's PEFT models are transformers, not model kind {spec.kind!r}"
    for key in ("tp", "pp", "cp", "ep"):
        if getattr(spec, key) > 1:
            return f"{key}={getattr(spec, key)}: the Trainer runs data parallelism only"
    if spec.zero == 1:
        return "zero=1: the Trainer's FSDP shards gradients too (zero 2) or the weights (3)"
    if spec.optimizer == "sgd":
        return (
            "optimizer: sgd keeps a momentum buffer; the Trainer's optim 'sgd' is "
            "torch.optim.SGD without momentum (optimizer: sgd-nomomentum)"
        )
    if spec.optimizer_in_backward:
        return (
            "optimizer_in_backward: the Trainer steps after backward (torchtune's "
            "optimizer_in_bwd runs it)"
        )
    if (
        spec.optimizer == "adamw-bf16"
        and spec.optimizer_implementation == "foreach"
        and not sharded_qlora(spec)
    ):
        return (
            "optimizer_implementation: foreach with adamw-bf16: the Trainer's AdamW with bf16 "
            "states is adamw_anyprecision, which steps tensor by tensor"
        )
    if spec.precision not in ("bf16", "fp16", "fp32"):
        return (
            f"precision {spec.precision}: the Trainer trains in fp32 or in bf16 or fp16 mixed "
            "precision"
        )
    if fsdp_shards(spec) and spec.fsdp_reduce_dtype == "fp32" and spec.precision != "fp32":
        return (
            "fsdp_reduce_dtype: fp32: the Trainer's FSDP reduces the gradients in the training "
            "precision (accelerate's set_mixed_precision); no TrainingArguments key writes fp32"
        )
    if layers.selective:
        return (
            "selective recomputation of the attention core: the Trainer's gradient "
            "checkpointing wraps whole decoder layers"
        )
    if layers.stores_all or layers.uniform_size() == 1:
        return None
    return (
        "these layer segments: the Trainer's gradient_checkpointing recomputes every layer "
        "(one per checkpoint) or none"
    )


def values(plan: Plan, layers: LayerSegments) -> dict[str, dict[str, object]]:
    """The keyword arguments of each object of the snippet, by object name."""
    spec = plan.spec
    out: dict[str, dict[str, object]] = {}
    fmt = spec.weight_format
    if fmt in ("nf4", "fp4"):
        out["BitsAndBytesConfig"] = {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": fmt,
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": COMPUTE_DTYPES[spec.precision],
        }
    elif fmt == "int8":
        out["BitsAndBytesConfig"] = {"load_in_8bit": True}
    if spec.finetune.adapters:
        alpha = spec.lora_alpha if spec.lora_alpha is not None else PEFT_LORA_ALPHA
        targets = spec.lora_targets
        out["LoraConfig"] = {
            "r": spec.lora_rank,
            "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "target_modules": targets if targets == "all-linear" else targets.split(","),
            "lora_dropout": spec.lora_dropout,
            "task_type": "CAUSAL_LM",
        }
        if spec.finetune.use_dora:
            out["LoraConfig"]["use_dora"] = True
    args: dict[str, object] = {
        "output_dir": "out",
        "per_device_train_batch_size": spec.micro_batch,
        "gradient_accumulation_steps": spec.microbatches,
        "gradient_checkpointing": bool(layers.recomputed),
    }
    if layers.recomputed:
        # the checkpointing ckplan counted: reentrant under transformers 4.44's default
        reentrant = frameworks.checkpoint_reentrant(spec)
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": reentrant}
    args["optim"] = OPTIM[spec.optimizer]
    # torch's AdamW keeps the bf16 parameters' dtype: a sharded QLoRA's adamw-bf16
    torch_adamw = spec.optimizer == "adamw" or (
        spec.optimizer == "adamw-bf16" and sharded_qlora(spec)
    )
    if torch_adamw and frameworks.optimizer_implementation(spec) == "foreach":
        args["optim"] = FOREACH_ADAMW  # the step ckplan counted, with its exp_avg_sq copy
    elif torch_adamw:
        args["optim"] = OPTIM["adamw"]
    elif spec.optimizer == "adamw-bf16":
        args["optim_args"] = ANYPRECISION_ARGS
    if spec.precision in ("bf16", "fp16"):  # neither flag: the Trainer trains in fp32
        args[spec.precision] = True
    if fsdp_shards(spec):
        # "offload": FSDP's CPU offload of the parameters, their gradients and the step
        # (transformers training_args.py FSDPOption.OFFLOAD -> fsdp_config cpu_offload)
        offload = " offload" if spec.param_offload != "none" else ""
        args["fsdp"] = FSDP[spec.zero] + offload
        # the FSDP whose buffers ckplan counted (`fsdp_version`: by default the release's, FSDP2
        # from transformers v5.10.1, training_args.py `fsdp_config.get("version", 2)`), said
        # explicitly so that no other release's default applies
        args["fsdp_config"] = {"version": frameworks.fsdp_version(spec)}
        if spec.fsdp_backward_prefetch is not None:  # as the Trainer reads FSDP1's
            args["fsdp_config"]["backward_prefetch"] = spec.fsdp_backward_prefetch
        if "BitsAndBytesConfig" in out and fmt in ("nf4", "fp4"):
            # FSDP flattens the packed 4-bit weights with the rest: a float storage dtype
            out["BitsAndBytesConfig"]["bnb_4bit_quant_storage"] = COMPUTE_DTYPES[spec.precision]
    out["TrainingArguments"] = args
    return out


def fsdp_shards(spec: ModelSpec) -> bool:
    """Whether the Trainer runs the plan under FSDP (`fsdp` set): ZeRO 2 or 3 over more than
    one rank."""
    return spec.dp > 1 and spec.zero in FSDP


def sharded_qlora(spec: ModelSpec) -> bool:
    """A 4-bit model under FSDP: transformers loads it in its storage dtype and TRL's
    SFTTrainer leaves it unprepared (trl v0.8.0 trl/trainer/sft_trainer.py `is_sharded_qlora`:
    "one should never call peft_module_casting_to_bf16 or prepare_model_for_kbit_training when
    doing QLoRA + FSDP / DS-Zero3"), so its unquantised weights and, through PEFT's
    `update_layer` (v0.10.0: the adapters cast to the base weight's floating dtype), its
    adapters stay in bf16."""
    return fsdp_shards(spec) and spec.weight_format in ("nf4", "fp4")


def _literal(value: object) -> str:
    if isinstance(value, str) and value.startswith("torch."):
        return value  # a dtype, not a string
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value).replace("'", '"')


def loaded_dtype(spec: ModelSpec) -> str:
    """The dtype the snippet loads an unquantised model in: the one ckplan counted its weights
    in (`weight_bytes`: 4 fp32, 2 the run's half precision). Named, because `from_pretrained`'s
    default changed: float32 up to transformers v4.57, the checkpoint's own dtype from v5
    (`dtype="auto"`, huggingface/transformers PR #42805); the `dtype` keyword is v4.56's (PR
    #39782, `torch_dtype` before)."""
    if spec.weight_bytes >= 4:
        return COMPUTE_DTYPES["fp32"]
    return COMPUTE_DTYPES["fp16" if spec.precision == "fp16" else "bf16"]


def render(plan: Plan, layers: LayerSegments) -> str:
    spec = plan.spec
    objects = values(plan, layers)
    names = {
        "BitsAndBytesConfig": "bnb_config",
        "LoraConfig": "lora_config",
        "TrainingArguments": "training_args",
    }
    quantized = "BitsAndBytesConfig" in objects
    load_dtype = None if quantized else loaded_dtype(spec)
    lines = [f"# ckplan plan {plan.strategy} for {spec.name}: Hugging Face Trainer with PEFT"]
    if quantized or load_dtype:
        lines.append("import torch")
    if "LoraConfig" in objects:
        lines.append("from peft import LoraConfig")
    imported = [name for name in ("BitsAndBytesConfig", "TrainingArguments") if name in objects]
    lines += [f"from transformers import {', '.join(imported)}", ""]
    for name, kwargs in objects.items():
        lines.append(f"{names[name]} = {name}(")
        lines.extend(f"    {key}={_literal(value)}," for key, value in kwargs.items())
        lines.append(")")
    config = ", quantization_config=bnb_config" if quantized else f", dtype={load_dtype}"
    if sharded_qlora(spec):  # the unquantised weights in the 4-bit storage's dtype
        config += f", dtype={COMPUTE_DTYPES[spec.precision]}"
    lines.append(f"# model = AutoModelForCausalLM.from_pretrained(NAME{config})")
    if quantized and not sharded_qlora(spec):
        lines.append("# model = peft.prepare_model_for_kbit_training(model)")
    if "LoraConfig" in objects and sharded_qlora(spec):  # as TRL builds it (peft >= 0.12)
        lines.append(
            "# model = peft.get_peft_model(model, lora_config, autocast_adapter_dtype=False)"
        )
    elif "LoraConfig" in objects:
        lines.append("# model = peft.get_peft_model(model, lora_config)")
    lines.append("# Trainer(model=model, args=training_args, train_dataset=...).train()")
    return "\n".join(lines) + "\n"


def notes(plan: Plan, layers: LayerSegments) -> list[str]:
    spec = plan.spec
    lines = []
    if spec.framework != "hf":
        lines.append(
            f"the plan's model states are {spec.framework}'s bytes per parameter; "
            "framework: hf gives the Trainer's (fp32 weights and Adam, autocast copies)"
        )
    if spec.training == "frozen":
        lines.append("training: frozen: freeze the base model's parameters in the training code")
    if spec.loss.startswith("chunked") or spec.loss in ("fused", "xentropy"):
        lines.append(
            f"loss: {spec.loss}: the Trainer materialises the logits; "
            "use_liger_kernel=True gives a fused linear cross-entropy"
        )
    if spec.optimizer == "adamw-bf16" and not sharded_qlora(spec):
        lines.append("optim adamw_anyprecision needs torchdistx installed")
    if spec.optimizer == "paged-adamw-8bit":
        lines.append(
            "paged_adamw_8bit: ckplan counts its states on the GPU; they move to host memory "
            "only under memory pressure"
        )
    if sharded_qlora(spec) and (spec.weight_bytes, spec.master_bytes) != (2, 0):
        lines.append(
            "FSDP over a 4-bit model: its other weights and adapters stay in bf16 (no "
            "prepare_model_for_kbit_training); ckplan counted weight_bytes "
            f"{spec.weight_bytes}, master_bytes {spec.master_bytes}: --set weight_bytes=2 "
            "--set grad_bytes=2 --set master_bytes=0 --set optimizer=adamw-bf16 counts them so"
        )
    if spec.dp > 1:
        lines.append(f"launch {spec.dp} processes (torchrun or accelerate launch)")
    return lines
