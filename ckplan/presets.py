"""Where model descriptions come from: shipped presets, the user's YAML, or a HF config.json.

This is the I/O edge of the library: everything here reads files and hands a mapping to
`spec.spec_from_mapping`, which does all validation. Presets ship inside the package
(`ckplan.preset_data`), so a wheel install finds them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from ckplan.spec import ModelSpec, SpecError, spec_from_mapping


def _preset_folder() -> Traversable:
    """The shipped presets: the `ckplan.preset_data` package of an install (wheel or editable),
    else the source tree's presets/ folder (running from a checkout without installing)."""
    try:
        return resources.files("ckplan.preset_data")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "presets"


def preset_names() -> list[str]:
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in _preset_folder().iterdir()
        if entry.name.endswith(".yaml")
    )


def preset_mapping(name: str) -> dict[str, Any]:
    """The raw mapping of a shipped preset (before validation)."""
    entry = _preset_folder().joinpath(f"{name}.yaml")
    if not entry.is_file():
        raise SpecError(_unknown_model(name))
    return _parse_yaml(entry.read_text(encoding="utf-8"), f"preset {name}")


def load_mapping(model: str) -> tuple[dict[str, Any], str]:
    """Resolve MODEL (preset name, .yaml/.yml path, or config.json path) to (mapping, origin)."""
    path = Path(model)
    if path.suffix in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise SpecError(f"{model}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise SpecError(f"{model}: cannot read file ({error})") from None
        if path.suffix == ".json":
            return hf_config_mapping(_parse_json(text, model), model), model
        return _parse_yaml(text, model), model
    if model in preset_names():
        return preset_mapping(model), f"preset {model}"
    raise SpecError(_unknown_model(model))


def load_spec(model: str, overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """Load MODEL and apply `--set`-style overrides before validation."""
    mapping, origin = load_mapping(model)
    return spec_from_mapping({**mapping, **(overrides or {})}, origin)


def _unknown_model(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, preset_names(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"unknown model {name!r}{hint}: expected a preset name (see `ckplan presets`), "
        "a .yaml file or a config.json"
    )


def _parse_yaml(text: str, origin: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "invalid YAML"
        raise SpecError(f"{origin}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError(
            f"{origin}: expected a YAML mapping of keys to values, got {type(data).__name__}"
        )
    return data


def _parse_json(text: str, origin: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise SpecError(f"{origin}: malformed JSON at line {error.lineno}: {error.msg}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: expected a JSON object, got {type(data).__name__}")
    return data


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
