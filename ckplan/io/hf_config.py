"""Hugging Face `config.json` -> ckplan's model keys, family by family."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckplan.model.spec import SpecError

# Hugging Face config.json key -> ckplan key, for the two config families in use.
_HF_KEYS = {
    "num_hidden_layers": "layers",
    "n_layer": "layers",
    "hidden_size": "hidden",
    "n_embd": "hidden",
    "num_attention_heads": "heads",
    "n_head": "heads",
    "num_key_value_heads": "kv_heads",
    "intermediate_size": "ffn_hidden",
    "n_inner": "ffn_hidden",
    "vocab_size": "vocab",
    "max_position_embeddings": "seq",
    "n_positions": "seq",
    "tie_word_embeddings": "tied_embeddings",
}
_HF_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def hf_config_mapping(config: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Translate a Hugging Face `config.json` into ckplan's keys.

    Llama-family configs (`rms_norm_eps`, `hidden_act: silu`) become rmsnorm + SwiGLU + RoPE
    without biases, trained with flash attention (the usual choice); GPT-2-family configs become
    layernorm + GELU with learned positions, standard attention and biases. `seq` defaults to the
    model's maximum context; override it with --seq.
    """
    mapping: dict[str, Any] = {"name": Path(origin).parent.name or "hf-model", "source": origin}
    for hf_key, key in _HF_KEYS.items():
        if config.get(hf_key) is not None and key not in mapping:
            mapping[key] = config[hf_key]
    if "layers" not in mapping or "hidden" not in mapping or "heads" not in mapping:
        raise SpecError(
            f"{origin}: not a recognised Hugging Face config: needs num_hidden_layers, "
            "hidden_size and num_attention_heads (or n_layer, n_embd, n_head)"
        )
    llama_like = "rms_norm_eps" in config or config.get("hidden_act") == "silu"
    mapping |= {
        "norm": "rmsnorm" if "rms_norm_eps" in config else "layernorm",
        "mlp": "swiglu" if config.get("hidden_act") == "silu" else "gelu",
        "positions": "rope" if llama_like else "learned",
        "attention": "flash" if llama_like else "standard",
        "bias": bool(config.get("attention_bias", False)) if llama_like else True,
        "micro_batch": 1,
        "dtype_bytes": _HF_DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2),
    }
    if "tied_embeddings" not in mapping and config.get("model_type") == "gpt2":
        mapping["tied_embeddings"] = True
    if not llama_like and "attn_pdrop" in config:
        mapping["dropout"] = config["attn_pdrop"]
    return mapping
