"""`ckplan calibrate --hf`: the real Hugging Face decoder layer, built from the config with
random weights at a calibration shape (torch and transformers needed).

Llama-family configs (rmsnorm + swiglu, or a config.json whose model_type is llama, mistral,
qwen2, ... with a `<Name>DecoderLayer` and a `<Name>RotaryEmbedding`) and GPT-2 (layernorm +
gelu, `GPT2Block`) are supported. The layer runs as the model would call it in training:
attn_implementation "eager" for `attention: standard`, "sdpa" for `attention: flash`; the eager
path gets the 4-D additive causal mask and the sdpa path none (is_causal), as transformers'
mask functions give them for an unpadded batch. RoPE's cos and sin and the mask are computed
once per model forward and shared by every layer: they are inputs here, not counted.

Fine-tuning (`training` of `hf_block`): "frozen" freezes every weight of the layer, the norms'
gains too; "lora" freezes them and adds PEFT's own LoRA layers on the spec's `lora_targets` with
its `lora_rank`, `lora_alpha` and `lora_dropout` (peft.inject_adapter_in_model, peft v0.21.2),
in the layer's dtype (as under autocast, or with adapters in the model's dtype).
"""

from __future__ import annotations

import importlib
import inspect

import torch

from ckplan.calibrate.block import Block, CalibrationError
from ckplan.calibrate.fit import Shape
from ckplan.model.spec import ModelSpec

# ckplan's architecture -> the Hugging Face model type built for it when the model is no
# config.json naming its own.
DEFAULT_TYPES = {("rmsnorm", "swiglu"): "llama", ("layernorm", "gelu"): "gpt2"}


def model_type(spec: ModelSpec, config: dict | None) -> str:
    if config and config.get("model_type"):
        return str(config["model_type"])
    try:
        return DEFAULT_TYPES[(spec.norm, spec.mlp)]
    except KeyError:
        raise CalibrationError(
            f"--hf knows no Hugging Face layer for {spec.norm} + {spec.mlp}; give a config.json"
        ) from None


def hf_block(
    spec: ModelSpec,
    shape: Shape,
    dtype: torch.dtype,
    device: str,
    config: dict | None = None,
    training: str = "full",
) -> Block:
    """The layer at `shape`; `training`: "full" (every weight trains), "frozen" or "lora"
    (module docstring)."""
    import transformers

    kind = model_type(spec, config)
    if training != "full" and kind == "gpt2":
        raise CalibrationError(
            "--hf measures frozen weights and LoRA on Llama-family layers (PEFT's q_proj, ..., "
            "down_proj), not GPT-2's Conv1D"
        )
    keys = {k: v for k, v in (config or {}).items() if k not in ("model_type", "architectures")}
    try:
        hf_config = transformers.AutoConfig.for_model(kind, **keys)
        _resize(hf_config, spec, shape)
        hf_config._attn_implementation = "sdpa" if spec.attention == "flash" else "eager"
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        if kind == "gpt2":
            return _gpt2(module, hf_config, shape, dtype, device)
        block = _llama_like(module, hf_config, shape, dtype, device, kind)
        finetuned(block.layer, spec, training, dtype)
        return block
    except CalibrationError:
        raise
    except Exception as error:  # transformers' own errors, whatever their type: one line
        message = " ".join(str(error).split())[:200]
        raise CalibrationError(
            f"--hf: transformers could not build a {kind!r} layer ({type(error).__name__}: "
            f"{message})"
        ) from None


def finetuned(layer: torch.nn.Module, spec: ModelSpec, training: str, dtype: torch.dtype) -> None:
    """Freeze the layer's weights and, for "lora", add PEFT's LoRA layers in place (module
    docstring). PEFT starts B at zero; the bytes saved do not depend on the values."""
    if training == "full":
        return
    layer.requires_grad_(False)
    if training == "frozen":
        return
    import peft

    finetune = spec.finetune
    alpha = {} if finetune.lora_alpha is None else {"lora_alpha": finetune.lora_alpha}
    config = peft.LoraConfig(
        r=finetune.lora_rank,
        target_modules=list(finetune.adapters),
        lora_dropout=finetune.lora_dropout,
        **alpha,
    )
    peft.inject_adapter_in_model(config, layer)
    layer.to(dtype=dtype)
    if not any(p.requires_grad for p in layer.parameters()):
        raise CalibrationError("--hf: PEFT added no trainable adapter to the layer")


def _resize(hf_config, spec: ModelSpec, shape: Shape) -> None:
    """The calibration shape on the config (both key families), dropout from the spec."""
    sizes = {
        "hidden_size": shape.hidden,
        "n_embd": shape.hidden,
        "num_attention_heads": shape.heads,
        "n_head": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "intermediate_size": shape.ffn,
        "n_inner": shape.ffn,
        "head_dim": shape.hidden // shape.heads,
        "attention_dropout": spec.dropout,
        "attn_pdrop": spec.dropout,
        "resid_pdrop": spec.dropout,
        "num_hidden_layers": 1,
        "n_layer": 1,
    }
    for key, value in sizes.items():
        if hasattr(hf_config, key):
            setattr(hf_config, key, value)


def _find(module, suffix: str, kind: str):
    classes = [c for n, c in inspect.getmembers(module, inspect.isclass) if n.endswith(suffix)]
    classes = [c for c in classes if c.__module__ == module.__name__]
    if not classes:
        raise CalibrationError(f"--hf: transformers' {kind} has no *{suffix} class")
    return classes[0]


def _causal_mask(shape: Shape, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The 4-D additive mask transformers gives eager attention: 0 on and below the diagonal,
    the dtype's minimum above it."""
    s = shape.seq
    mask = torch.full((s, s), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None].expand(shape.batch, 1, s, s)


def _llama_like(module, hf_config, shape, dtype, device, kind) -> Block:
    layer_cls = _find(module, "DecoderLayer", kind)
    rotary_cls = _find(module, "RotaryEmbedding", kind)
    layer = layer_cls(hf_config, layer_idx=0).to(device=device, dtype=dtype).train()
    rotary = rotary_cls(config=hf_config).to(device=device)
    positions = torch.arange(shape.seq, device=device)[None].expand(shape.batch, -1)
    probe = torch.zeros(1, dtype=dtype, device=device)
    cos, sin = rotary(probe, positions)
    mask = None if hf_config._attn_implementation == "sdpa" else _causal_mask(shape, dtype, device)
    inputs = [t for t in (cos, sin, mask, positions) if t is not None]

    def forward(x, recorder):
        out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    return Block(layer, forward, {t.untyped_storage().data_ptr() for t in inputs})


def _gpt2(module, hf_config, shape, dtype, device) -> Block:
    if shape.kv_heads != shape.heads:
        raise CalibrationError("--hf: GPT-2 has no grouped-query attention (kv_heads = heads)")
    layer = module.GPT2Block(hf_config, layer_idx=0).to(device=device, dtype=dtype).train()
    mask = None if hf_config._attn_implementation == "sdpa" else _causal_mask(shape, dtype, device)

    def forward(x, recorder):
        out = layer(x, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out

    exclude = set() if mask is None else {mask.untyped_storage().data_ptr()}
    return Block(layer, forward, exclude)
