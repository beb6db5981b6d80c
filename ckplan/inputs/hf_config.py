"""Hugging Face `config.json` -> ckplan's model keys, family by family.

Each supported `model_type` is mapped key by key, with the defaults of its transformers config
class for the keys a checkpoint leaves out (Gemma 3's sparse text_config relies on them). Keys
that change what ckplan counts are either modelled (qkv bias, tied embeddings, head_dim,
qk-norm, post-norms, parallel residual, sliding windows, experts, MLA, dropout rates, a
multimodal file's language model in text_config) or refused with an error
naming them; keys that change nothing ckplan counts are ignored on purpose: RoPE settings and
partial rotary (no parameters, nothing saved), logit soft-capping (an element-wise tanh fused in
the kernels), Gemma's embedding scaling, router details (group-limited top-k, scaling factors).
`seq` is DEFAULT_SEQ (or the model's maximum context where that is shorter), never the maximum
context itself: a planner asked about a 131,072-token model should not silently plan at 131,072
tokens. The source line says so, with the model's limit; --seq changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckplan.inputs.files import LongInteger
from ckplan.model.layers import format_layer_set
from ckplan.model.spec import SIZE_RANGES, SpecError
from ckplan.quoting import quote

DEFAULT_SEQ = 4096  # tokens, for a config.json that --seq does not set
# bytes per activation value of the run a config.json is planned as: bf16 mixed precision,
# whatever dtype the checkpoint is stored in (torch_dtype float32 is how Gemma 2, OLMo 2 and
# GPT-2 ship, not how they train); precision=fp32 plans a full-fp32 run
TRAINING_DTYPE_BYTES = 2
_HF_DTYPES = ("float32", "float16", "bfloat16", "float64")  # torch_dtype, dtype
# Integer keys ckplan reads, checked for their JSON type before anything computes with them
# (a JSON "32" would pass as --set's text does; a dict in head_dim would multiply).
_INTEGER_KEYS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim", "n_layer", "n_embd",
    "n_head", "n_inner", "n_positions", "sliding_window", "num_local_experts",
    "num_experts_per_tok", "num_experts", "moe_intermediate_size",
    "shared_expert_intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "n_group",
    "topk_group", "num_mtp_modules", "moe_num_experts", "moe_k", "moe_num_shared_experts",
    "moe_layer_start_index", "moe_layer_end_index", "num_mtp_layers", "shared_intermediate_size",
)  # fmt: skip
# Integer keys that pick layers: whole numbers, the divisors at least 1.
_LAYER_RULE_KEYS = {
    "decoder_sparse_step": 1, "moe_layer_freq": 1, "sliding_window_pattern": 1,
    "_sliding_window_pattern": 1, "max_window_layers": 0, "first_k_dense_replace": 0,
    "num_nextn_predict_layers": 0, "no_rope_layer_interval": 1, "moe_layer_interval": 1,
}  # fmt: skip
# num_key_value_heads where the config class's default is a number of its own, not the query
# heads (configuration_<family>.py, transformers v5.25.0): a config.json without the key gets it.
_KV_HEADS = {
    "mistral": 8, "mixtral": 8, "qwen2": 32, "qwen2_moe": 16, "qwen3": 32, "qwen3_moe": 4,
    "gemma": 16, "gemma2": 4, "smollm3": 4, "glm4": 2, "glm4_moe": 8, "gpt_oss": 8,
    "ministral": 8, "ministral3": 8, "qwen3_vl_text": 32, "qwen3_vl_moe_text": 16,
    "seed_oss": 8, "ernie4_5": 2, "helium": 20, "starcoder2": 2, "qwen2_vl_text": 8,
    "qwen2_5_vl_text": 8, "exaone4": 32, "minimax_m2": 8, "ernie4_5_moe": 4,
}  # fmt: skip
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_MOE_FAMILIES = (
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "olmoe",
    "gpt_oss", "qwen3_vl_moe_text", "minimax_m2", "ernie4_5_moe", "granitemoe", "granitemoeshared",
)  # fmt: skip


def hf_config_mapping(
    config: Mapping[str, Any], origin: str, with_context: bool = False
) -> dict[str, Any]:
    """Translate a Hugging Face `config.json` into ckplan's keys (see the module docstring);
    `with_context` adds the model's own maximum context as `_max_seq` for `seq_note`."""
    model_type = config.get("model_type")
    notes: list[str] = []
    families, label = _FAMILIES, model_type
    # a gemma3 file without text_config is the text model itself (Gemma3ForCausalLM)
    if (
        isinstance(model_type, str)
        and model_type in _TEXT_TOWERS
        and (model_type != "gemma3" or config.get("text_config") is not None)
    ):
        config, inner = _text_tower(config, origin, model_type)
        families, label = _FAMILIES | _TOWER_FAMILIES, f"{model_type}, text model {inner}"
        model_type = inner
        notes.append(_VISION_NOTE)
        if "_tie_note" in config:
            notes.append(config.pop("_tie_note"))
    if model_type is not None and not isinstance(model_type, str):
        raise SpecError(
            f"{origin}: key 'model_type' expects a string such as llama, got {quote(model_type)}"
        )
    if model_type is None:
        if "n_layer" in config or "num_hidden_layers" in config:
            raise SpecError(
                f"{origin}: not a recognised Hugging Face config: it has no model_type "
                f"(supported: {', '.join(SUPPORTED)})"
            )
        raise SpecError(
            f"{origin}: not a recognised Hugging Face config: needs model_type and "
            "num_hidden_layers, hidden_size, num_attention_heads (or n_layer, n_embd, n_head)"
        )
    family = families.get(model_type)
    if family is None:
        raise SpecError(
            f"{origin}: unsupported model_type {quote(model_type)}; supported: "
            f"{', '.join(SUPPORTED)}"
        )
    _check_types(config, origin, model_type)
    mapping = family(_Config(config, origin, model_type))
    stored = config.get("torch_dtype") or config.get("dtype")
    if stored in ("float32", "float64"):
        notes.append(
            f"the checkpoint is stored in {stored}: planned as bf16 mixed-precision training, "
            "2-byte activations (precision=fp32 for a run in fp32)"
        )
    quantization = config.get("quantization_config")
    if isinstance(quantization, Mapping):
        method = quantization.get("quant_method")
        named = f" ({method})" if isinstance(method, str) and method.isidentifier() else ""
        notes.append(
            f"the checkpoint's quantization_config{named} is not read: weights counted at "
            "the config's dtype (weight_format for a quantized base)"
        )
    mapping = {"name": Path(origin).parent.name or "hf-model", **mapping}
    longest = mapping["seq"]
    low, high = SIZE_RANGES["seq"]
    if isinstance(longest, int) and not low <= longest <= high:
        key = "n_positions" if model_type == "gpt2" else "max_position_embeddings"
        raise SpecError(f"{origin}: key {key!r} must be in {low:,}..{high:,}, got {quote(longest)}")
    mapping["seq"] = min(DEFAULT_SEQ, longest) if isinstance(longest, int) else longest
    if with_context:
        mapping["_max_seq"] = longest
    source = f"{origin} (HF model_type {label})"
    if notes or mapping.get("_notes"):
        source += "; " + "; ".join([*notes, *mapping.pop("_notes", [])])
    mapping.pop("_notes", None)
    mapping["source"] = source
    return mapping


# Multimodal checkpoints whose language model ckplan reads from `text_config`: the outer
# model_type -> the text models it may hold (the first when text_config names none) and the
# outer config class's tie_word_embeddings. The outer config decides the tie: the
# ForConditionalGeneration model ties lm_head to the language model's embedding by its own
# config (PreTrainedModel.get_expanded_tied_weights_keys reads `self.config`, transformers
# v5.25.0 modeling_utils.py), whatever text_config says.
_TEXT_TOWERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gemma3": (("gemma3_text",), True),  # Gemma3Config
    "mistral3": (("mistral", "ministral3"), True),  # Mistral3Config: Mistral Small 3.x, Ministral 3
    "qwen3_vl": (("qwen3_vl_text",), False),  # Qwen3VLConfig
    "qwen3_vl_moe": (("qwen3_vl_moe_text",), False),  # Qwen3VLMoeConfig
    "qwen2_vl": (("qwen2_vl_text",), False),  # Qwen2VLConfig
    "qwen2_5_vl": (("qwen2_5_vl_text",), False),  # Qwen2_5_VLConfig
}
# Qwen2-VL and Qwen2.5-VL: hub files keep the text model's keys at the top level, from which
# the config builds text_config when there is none, and a text_config that ties (the files
# before transformers v5) ties the model whatever the top level says
# (Qwen2VLConfig.__post_init__, Qwen2_5_VLConfig.__post_init__, v5.25.0).
_FLAT_TOWERS = ("qwen2_vl", "qwen2_5_vl")
_NOT_TEXT_KEYS = ("model_type", "architectures", "text_config", "vision_config")
# The text models' own config classes' tie_word_embeddings (Qwen3VLTextConfig has none).
_TEXT_TIES = {"gemma3_text": True, "mistral": False, "ministral3": False, "qwen3_vl_moe_text": True}
_VISION_NOTE = (
    "the language model of a multimodal checkpoint: the vision tower, the projector and any "
    "adapter a target name puts on them not counted"
)


def _text_tower(config: Mapping[str, Any], origin: str, outer: str) -> tuple[dict, str]:
    """The language model of a multimodal config.json (`_TEXT_TOWERS`): its text_config, with
    the outer file's dtype and tie_word_embeddings."""
    text = config.get("text_config")
    if text is None and outer in _FLAT_TOWERS:
        text = {key: value for key, value in config.items() if key not in _NOT_TEXT_KEYS}
    if text is None:
        raise SpecError(
            f"{origin}: key 'text_config' is missing: a {outer} config holds its language "
            "model's config there"
        )
    if not isinstance(text, Mapping):
        raise SpecError(
            f"{origin}: key 'text_config' expects the language model's config (a mapping) in a "
            f"{outer} config, got {quote(text)}"
        )
    kinds, tied = _TEXT_TOWERS[outer]
    inner = text.get("model_type", kinds[0])
    if inner not in kinds:
        raise SpecError(
            f"{origin}: key 'text_config.model_type' of a {outer} config expects "
            f"{' or '.join(kinds)}, got {quote(inner)}"
        )
    text = dict(text)
    for key in ("torch_dtype", "dtype", "quantization_config"):
        text.setdefault(key, config.get(key))
    tie = config.get("tie_word_embeddings")
    nested = config.get("text_config") or {}
    if outer in _FLAT_TOWERS and not tie and nested.get("tie_word_embeddings") is True:
        tie = True
    text["tie_word_embeddings"] = tied if tie is None else tie
    own = nested.get("tie_word_embeddings", _TEXT_TIES.get(inner))
    if tie is None and own not in (None, tied):  # a text model that would tie otherwise
        text["_tie_note"] = (
            f"output layer {'tied to' if tied else 'apart from'} the embedding by the "
            f"{outer} config's default, the file's top level having no tie_word_embeddings "
            "(transformers ties by that config, not text_config's; --set tied_embeddings to "
            "change)"
        )
    return text, inner


def seq_note(mapping: Mapping[str, Any]) -> str:
    """Where a config.json's sequence length came from, for the source line."""
    longest = mapping.get("_max_seq")
    return (
        f"seq {mapping['seq']:,}: ckplan's default for a config.json (the model allows up to "
        f"{longest:,} tokens; --seq to change)"
    )


def _check_types(config: Mapping[str, Any], origin: str, model_type: str) -> None:
    """The JSON types of the keys ckplan reads (null: absent, the family's default)."""

    for key in _INTEGER_KEYS:
        value = config.get(key)
        if value is None or isinstance(value, LongInteger | float):
            continue  # the spec says what is wrong with a float or a huge integer, by range
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{origin}: key {key!r} expects an integer, got {quote(value)}")
    most_layers = SIZE_RANGES["layers"][1]  # a layer rule's step or count
    for key, low in _LAYER_RULE_KEYS.items():
        value = config.get(key)
        if value is None or (model_type == "exaone4" and isinstance(value, str)):
            continue  # EXAONE 4's pattern string ("LLLG") comes with its layer_types
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= most_layers:
            raise SpecError(
                f"{origin}: key {key!r} expects an integer in {low}..{most_layers:,}, "
                f"got {quote(value)}"
            )
    for key in ("mlp_only_layers", "no_rope_layers", "layer_types"):
        value = config.get(key)
        kind = str if key == "layer_types" else int
        if value is not None and (
            not isinstance(value, list)
            or not all(isinstance(item, kind) and not isinstance(item, bool) for item in value)
        ):
            what = {"layer_types": "layer type names", "no_rope_layers": "0/1 flags, one a layer"}
            what = what.get(key, "layer indices")
            raise SpecError(f"{origin}: key {key!r} expects a list of {what}, got {quote(value)}")
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if value is not None and (not isinstance(value, str) or value not in _HF_DTYPES):
            raise SpecError(
                f"{origin}: key {key!r} expects one of {', '.join(_HF_DTYPES)}, got {quote(value)}"
            )
    for key in ("hidden_act", "hidden_activation", "topk_method"):
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            raise SpecError(f"{origin}: key {key!r} expects a string, got {quote(value)}")
    if model_type not in _MOE_FAMILIES:
        for key in _EXPERT_KEYS:
            if config.get(key):
                raise SpecError(
                    f"{origin}: cannot model {key} in a {model_type} config (a dense family); "
                    f"ckplan reads experts for model_type {', '.join(_MOE_FAMILIES)}"
                )


class _Config:
    """A config.json with its family's defaults and one-line errors."""

    def __init__(self, data: Mapping[str, Any], origin: str, model_type: str):
        self.data, self.origin, self.model_type = data, origin, model_type

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def need(self, key: str, default: Any = None) -> Any:
        value = self.get(key, default)
        if value is None:
            raise SpecError(f"{self.origin}: {self.model_type} config lacks {key!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        """A JSON true/false (a string such as "false" would read as true under bool())."""
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"{self.origin}: key {key!r} expects true or false, got {quote(value)}")
        return value

    def refuse(self, keys: str, why: str) -> SpecError:
        return SpecError(f"{self.origin}: cannot model {keys} ({why})")


def _base(c: _Config, *, tied: bool, head_dim: int | None = None) -> dict[str, Any]:
    """The keys every RoPE decoder family shares (Llama's names)."""
    heads = c.need("num_attention_heads")
    hidden = c.need("hidden_size")
    mapping = {
        "layers": c.need("num_hidden_layers"),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": c.get("num_key_value_heads", _KV_HEADS.get(c.model_type, heads)),
        "ffn_hidden": c.need("intermediate_size"),
        "vocab": c.need("vocab_size"),
        "seq": c.need("max_position_embeddings"),
        "micro_batch": 1,
        "dtype_bytes": TRAINING_DTYPE_BYTES,
        "norm": "rmsnorm",
        "mlp": _gated_mlp(c),
        "attention": "flash",
        "positions": "rope",
        "bias": False,
        "dropout": 0.0,
        "tied_embeddings": c.flag("tie_word_embeddings", tied),
    }
    head_dim = c.get("head_dim", head_dim)
    if head_dim is not None and head_dim * heads != hidden:
        mapping["head_dim"] = head_dim
    return mapping


def _gated_mlp(c: _Config) -> str:
    act = str(c.get("hidden_activation", c.get("hidden_act", "silu")))
    if act in ("silu", "swish"):
        return "swiglu"
    if act.startswith("gelu"):
        return "geglu"
    raise c.refuse("hidden_act", f"{quote(act)}: ckplan models gated silu and gelu MLPs")


def _llama_biases(c: _Config) -> dict[str, Any]:
    """Llama-style attention_bias (Q, K, V and O) and mlp_bias: both or neither."""
    attention, mlp = c.flag("attention_bias", False), c.flag("mlp_bias", False)
    if attention != mlp:
        raise c.refuse(
            "attention_bias" if attention else "mlp_bias",
            "ckplan's biases are on every linear layer (bias) or on Q, K, V only (qkv_bias)",
        )
    return {"bias": attention}


def _capped(layers: int) -> int:
    """A layer count to loop over: at most one past the most ckplan accepts, which the spec then
    refuses with its range (a config of 10**30 layers was looped over layer by layer first).
    JSON's 32.0 counts as 32, as the spec reads it; any other count that is not an integer
    (2.5, NaN) gives no layer to loop over: the spec refuses it by its key in one line, as in
    every family without per-layer rules."""
    if isinstance(layers, float) and layers.is_integer():
        layers = int(layers)
    if isinstance(layers, bool) or not isinstance(layers, int):
        return 0
    return min(layers, SIZE_RANGES["layers"][1] + 1)


def _windows(
    c: _Config,
    layers: int,
    default_pattern: Callable[[int], bool] | None,
    default_window: int | None = None,
) -> dict:
    """sliding_window and which layers use it: HF's layer_types when given, else the family's
    rule (`default_pattern(i)` True for a sliding layer; None: every layer). `default_window`
    is the config class's window for a file without the key (one that sets null has none)."""
    layers = _capped(layers)
    window = c.data.get("sliding_window", default_window)
    if not window:
        return {}
    types = c.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != layers:
            raise c.refuse("layer_types", "ckplan models sliding_attention and full_attention")
        sliding = {i for i, kind in enumerate(types) if kind == "sliding_attention"}
    elif default_pattern is None:
        sliding = set(range(layers))
    else:
        sliding = {i for i in range(layers) if default_pattern(i)}
    if not sliding:
        return {}
    return {"sliding_window": window, "sliding_window_layers": format_layer_set(sliding, layers)}


def _moe_layers(layers: int, moe: set[int]) -> str:
    layers = _capped(layers)
    return format_layer_set(moe, layers)


# ---- the families ---------------------------------------------------------------------------


def _llama(c: _Config) -> dict[str, Any]:
    return {**_base(c, tied=False), **_llama_biases(c)}


def _mistral(c: _Config) -> dict[str, Any]:
    mapping = {**_base(c, tied=False), **_llama_biases(c)}
    # MistralConfig's default window is 4096; v0.2+ checkpoints set null (full attention).
    return mapping | _windows(c, mapping["layers"], None, default_window=4096)


def _mixtral(c: _Config) -> dict[str, Any]:
    mapping = {**_base(c, tied=False), **_llama_biases(c)}
    mapping |= _windows(c, mapping["layers"], None)
    mapping |= {"experts": c.get("num_local_experts", 8), "top_k": c.get("num_experts_per_tok", 2)}
    return mapping


def _qwen_windows(
    c: _Config, layers: int, sliding: Callable[[int, int], bool] | None, first: int = 28
) -> dict[str, Any]:
    """Qwen's windows (configuration_qwen2.py, configuration_qwen2_moe.py,
    configuration_qwen3.py, modeling_qwen3_moe.py, configuration_qwen2_vl.py and
    configuration_qwen2_5_vl.py, v5.25.0): only with use_sliding_window (the config classes set
    sliding_window None otherwise), 4,096 wide by default, on the layers layer_types names,
    else by the family's rule `sliding(i, max_window_layers)` (max_window_layers `first` by
    default); None: every layer, layer_types unread (Qwen3-MoE's attention takes
    config.sliding_window in every layer)."""
    if not c.flag("use_sliding_window", False):
        return {}
    if sliding is None:
        return _windows(_without_layer_types(c), layers, None, default_window=4096)
    start = c.get("max_window_layers", first)
    return _windows(c, layers, lambda i: sliding(i, start), default_window=4096)


def _without_layer_types(c: _Config) -> _Config:
    """The file as a family that gives every layer its window reads it: layer_types unread."""
    data = {key: value for key, value in c.data.items() if key != "layer_types"}
    return _Config(data, c.origin, c.model_type)


def _from_max_window_layers(i: int, start: int) -> bool:
    """Qwen2's, Qwen3's and Qwen2-VL's rule: the layers from max_window_layers on slide."""
    return i >= start


def _qwen2(c: _Config) -> dict[str, Any]:
    mapping = _base(c, tied=False) | {"qkv_bias": True}  # Qwen2Attention: q, k, v with bias
    return mapping | _qwen_windows(c, mapping["layers"], _from_max_window_layers)


def _qwen2_vl_text(c: _Config) -> dict[str, Any]:
    """Qwen2-VL's and Qwen2.5-VL's language model (Qwen2VLTextModel, Qwen2_5_VLTextModel,
    v5.25.0): Qwen2's layer (Q, K and V biased), its window rule with max_window_layers 80 by
    default. Their multimodal RoPE holds no parameters."""
    mapping = _base(c, tied=False) | {"qkv_bias": True}
    return mapping | _qwen_windows(c, mapping["layers"], _from_max_window_layers, first=80)


def _qwen3(c: _Config, head_dim: int | None = 128) -> dict[str, Any]:
    """Qwen3: QK-norms, head_dim 128 by default (Qwen3-MoE's class has none: h/a)."""
    mapping = {**_base(c, tied=False, head_dim=head_dim), **_llama_biases(c), "qk_norm": True}
    return mapping | _qwen_windows(c, mapping["layers"], _from_max_window_layers)


def _hunyuan_dense(c: _Config) -> dict[str, Any]:
    """Hunyuan dense (HunYuanDenseV1ForCausalLM, modeling_hunyuan_v1_dense.py v5.25.0): Llama's
    layer with per-head QK norms (query_layernorm, key_layernorm), applied after RoPE where
    Qwen3 applies them before: the same gains and, as RoPE saves only its cos and sin, the same
    saved tensors (the norm's input is the rotated projection instead of the projection).
    attention_bias biases Q, K, V and O, the MLP none: refused as Llama's."""
    return {**_base(c, tied=False), **_llama_biases(c), "qk_norm": True}


def _qwen_moe_layers(c: _Config, layers: int, experts: int) -> set[int]:
    """Qwen2/3-MoE: layer i is sparse unless in mlp_only_layers, every decoder_sparse_step."""
    layers = _capped(layers)
    step = c.get("decoder_sparse_step", 1)
    dense = set(c.get("mlp_only_layers", []))
    return {i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0}


def _qwen2_moe(c: _Config) -> dict[str, Any]:
    """Qwen2-MoE: Qwen2's layer (Q, K and V biased); its windows, with use_sliding_window, on
    the even layers below max_window_layers (Qwen2MoeConfig.__post_init__, v5.25.0)."""
    mapping = _base(c, tied=False) | {"qkv_bias": True}
    below = _qwen_windows(c, mapping["layers"], lambda i, start: i % 2 == 0 and i < start)
    mapping |= below
    mapping |= _qwen_experts(c, mapping["layers"], (60, 4, 1408))
    shared = c.get("shared_expert_intermediate_size", 5632)
    if shared:  # Qwen2MoeSparseMoeBlock: one shared expert with a sigmoid gate
        mapping |= {"shared_experts": 1, "shared_ffn_hidden": shared, "shared_expert_gate": True}
    return mapping


def _qwen3_moe(c: _Config) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's layer, head_dim h/a by default; with use_sliding_window its window on
    every layer (Qwen3MoeAttention, v5.25.0)."""
    mapping = {**_base(c, tied=False), **_llama_biases(c), "qk_norm": True}
    mapping |= _qwen_windows(c, mapping["layers"], None)
    return mapping | _qwen_experts(c, mapping["layers"], (128, 8, 768))


def _qwen_experts(c: _Config, layers: int, defaults: tuple[int, int, int]) -> dict[str, Any]:
    """Qwen's experts: num_experts of moe_intermediate_size, top num_experts_per_tok (each
    `defaults` where the file leaves it out), on the layers `_qwen_moe_layers` picks."""
    experts, top_k, width = defaults
    experts = c.get("num_experts", experts)
    return {
        "experts": experts,
        "top_k": c.get("num_experts_per_tok", top_k),
        "moe_ffn_hidden": c.get("moe_intermediate_size", width),
        "moe_layers": _moe_layers(layers, _qwen_moe_layers(c, layers, experts)),
    }


def _ministral(c: _Config) -> dict[str, Any]:
    """Ministral 8B (MinistralForCausalLM, modeling_ministral.py v5.25.0): Llama's layer, its
    projections without biases whatever attention_bias says, and a window on the layers
    layer_types names sliding_attention: every layer by default while sliding_window is set
    (4,096 in MinistralConfig; null: full attention everywhere)."""
    mapping = _base(c, tied=False) | {"bias": False}
    return mapping | _windows(c, mapping["layers"], None, default_window=4096)


def _ministral3(c: _Config) -> dict[str, Any]:
    """Ministral 3 (Ministral3ForCausalLM, modeling_ministral3.py v5.25.0), standalone or as the
    text model of a mistral3 checkpoint: Llama's layer without biases, head_dim 128 by default,
    sliding_window on every layer when set (none by default; layer_types is not read there).
    Its queries are scaled by position after RoPE (`get_llama_4_attn_scale`, rope_parameters'
    llama_4_scaling_beta): an element-wise product with a factor that needs no gradient, so
    autograd saves that (1, 1, s, 1) factor alone, nothing ckplan counts."""
    mapping = _base(c, tied=False, head_dim=128) | {"bias": False}
    return mapping | _windows(_without_layer_types(c), mapping["layers"], None)


def _qwen3_vl_text(c: _Config) -> dict[str, Any]:
    """Qwen3-VL's language model (Qwen3VLTextModel, modeling_qwen3_vl.py v5.25.0): Qwen3's
    layer, per-head QK norms and head_dim 128 by default, no window. Its interleaved
    multimodal RoPE and the DeepStack visual features added to the first layers' hidden
    states (by the vision tower's mergers) hold no parameter of the language model."""
    return {**_base(c, tied=False, head_dim=128), **_llama_biases(c), "qk_norm": True}


def _qwen3_vl_moe_text(c: _Config) -> dict[str, Any]:
    """Qwen3-VL-MoE's language model (Qwen3VLMoeTextModel, modeling_qwen3_vl_moe.py v5.25.0):
    Qwen3-MoE's layer (head_dim h/a by default; num_experts experts of moe_intermediate_size,
    top-k routing, no shared expert, a router without bias), sparse every
    decoder_sparse_step-th layer outside mlp_only_layers, with its config class's defaults
    (60 experts, top 4, 1,408 wide)."""
    mapping = {**_base(c, tied=False), **_llama_biases(c), "qk_norm": True}
    return mapping | _qwen_experts(c, mapping["layers"], (60, 4, 1408))


def _one_dropout(c: _Config, defaults: dict[str, float]) -> float:
    """The family's dropout rates (attention probabilities, the residual branches, the
    embedding: `defaults`, its config class's) as ckplan's one `dropout`, which applies one
    rate at each of those places (Korthikanti et al. 2022's layer). Rates that differ are
    refused: ckplan has one."""
    rates: dict[str, float] = {}
    for key, default in defaults.items():
        value = c.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise SpecError(f"{c.origin}: key {key!r} expects a rate in [0, 1), got {quote(value)}")
        rates[key] = value
    if len(set(rates.values())) > 1:
        given = ", ".join(f"{key} {value}" for key, value in rates.items())
        raise c.refuse(
            " and ".join(rates), f"{given}: ckplan's dropout is one rate at each of those places"
        )
    return next(iter(rates.values()))


def _seed_oss(c: _Config) -> dict[str, Any]:
    """Seed-OSS (SeedOssForCausalLM, modeling_seed_oss.py v5.25.0): Llama's layer, head_dim 128
    by default, biases on Q, K and V by attention_bias (true by default), on O by
    attention_out_bias and on the MLP by mlp_bias (false by default); dropout on the attention
    probabilities (attention_dropout) and after O and the MLP (residual_dropout), 0.1 each by
    default."""
    mapping = _base(c, tied=False, head_dim=128)
    biases = (
        c.flag("attention_bias", True),
        c.flag("attention_out_bias", False),
        c.flag("mlp_bias", False),
    )
    if biases == (True, False, False):
        mapping["qkv_bias"] = True
    elif len(set(biases)) == 1:
        mapping["bias"] = biases[0]
    else:
        raise c.refuse(
            "attention_bias, attention_out_bias and mlp_bias",
            "ckplan's biases are on every linear layer (bias) or on Q, K, V only (qkv_bias)",
        )
    rates = {"attention_dropout": 0.1, "residual_dropout": 0.1}
    return mapping | {"dropout": _one_dropout(c, rates)}


def _ernie4_5(c: _Config) -> dict[str, Any]:
    """ERNIE 4.5 dense (Ernie4_5ForCausalLM, modeling_ernie4_5.py v5.25.0): Llama's layer,
    head_dim 128 and tied embeddings by default, use_bias on every projection, attention's and
    the MLP's alike. Its interleaved RoPE holds no parameters."""
    mapping = _base(c, tied=True, head_dim=128)
    return mapping | {"bias": c.flag("use_bias", False)}


def _ernie4_5_moe(c: _Config) -> dict[str, Any]:
    """ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM, modeling_ernie4_5_moe.py v5.25.0): ERNIE 4.5's
    layer, tied by default, head_dim h/a unless given; a mixture of experts on the layers i with
    (i + 1) % moe_layer_interval == 0 from moe_layer_start_index (1) to moe_layer_end_index (-1:
    the last), dense MLPs of intermediate_size on the others; moe_num_experts experts (64) of
    moe_intermediate_size (1,536), top moe_k (6), a softmax router with a per-expert correction
    bias (moe_statics.e_score_correction_bias, in the checkpoint: expert_bias) and
    moe_num_shared_experts (2) shared experts, one MLP that many times as wide. use_bias, which
    would bias the output layer but not the experts, is refused. The router's weight and
    correction bias are fp32 parameters there, E·(h + 1) values a layer, counted at the run's
    weight bytes."""
    _refuse_bias_without_experts(c, "use_bias", "the projections and the output layer")
    mapping = _base(c, tied=True) | {"bias": False}
    layers = _capped(mapping["layers"])
    experts = c.get("moe_num_experts", c.get("num_experts", 64))
    start, end = c.get("moe_layer_start_index", 1), c.get("moe_layer_end_index", -1)
    for key, value in (("moe_layer_start_index", start), ("moe_layer_end_index", end)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(
                f"{c.origin}: key {key!r} expects an integer layer index, got {quote(value)}"
            )
    end = layers - 1 if end == -1 else end
    interval = c.get("moe_layer_interval", 1)
    moe = {i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end}
    notes = _mtp_notes(c, c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)))
    if not experts or not moe:
        return mapping | {"_notes": notes}
    return mapping | {
        "experts": experts,
        "top_k": c.get("moe_k", c.get("num_experts_per_tok", 6)),
        "moe_ffn_hidden": c.get("moe_intermediate_size", 1536),
        "moe_layers": _moe_layers(layers, moe),
        "shared_experts": c.get("moe_num_shared_experts", 2),
        "expert_bias": True,
        "_notes": notes,
    }


def _helium(c: _Config) -> dict[str, Any]:
    """Helium (HeliumForCausalLM, modeling_helium.py v5.25.0): Llama's layer with biases on Q, K
    and V by attention_bias, none on O (an h x h projection, so a·d must be h), the MLP's by
    mlp_bias; head_dim 128 by default."""
    mapping = _base(c, tied=False, head_dim=128)
    heads, hidden = mapping["heads"], mapping["hidden"]
    head_dim = mapping.get("head_dim")
    if head_dim is not None and isinstance(heads, int) and head_dim * heads != hidden:
        raise c.refuse("head_dim", "Helium's o_proj is hidden x hidden: heads x head_dim must be h")
    attention, mlp = c.flag("attention_bias", False), c.flag("mlp_bias", False)
    if mlp:
        raise c.refuse(
            "mlp_bias",
            "the MLP's biases without O's: ckplan's biases are on every linear layer (bias) or "
            "on Q, K, V only (qkv_bias)",
        )
    return mapping | {"qkv_bias": attention}


def _starcoder2(c: _Config) -> dict[str, Any]:
    """StarCoder2 (Starcoder2ForCausalLM, modeling_starcoder2.py v5.25.0): LayerNorm with its
    bias, a two-matrix MLP (c_fc, c_proj) with GeLU, biases on every projection by use_bias
    (true by default), tied embeddings by default, sliding_window on every layer when set, and
    one dropout rate on the attention probabilities, the residual branches and the embedding
    (0 by default)."""
    mapping = _base(c, tied=True)
    act = str(c.get("hidden_act", "gelu_pytorch_tanh"))
    if not act.startswith("gelu"):
        raise c.refuse("hidden_act", f"{quote(act)}: ckplan models StarCoder2's MLP with GeLU")
    rates = {"attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0}
    mapping |= {
        "norm": "layernorm",
        "mlp": "gelu",
        "bias": c.flag("use_bias", True),
        "dropout": _one_dropout(c, rates),
    }
    return mapping | _windows(c, mapping["layers"], None)


def _exaone4(c: _Config) -> dict[str, Any]:
    """EXAONE 4.0 (Exaone4ForCausalLM, modeling_exaone4.py v5.25.0): OLMo 2's layer, RMSNorm
    after attention and after the MLP and none before (`_POST_NORM_NOTE`), with per-head QK
    norms and no biases; sliding_window (4,096 by default; null: none) on the layers
    layer_types names sliding_attention, else on those where (i + 1) % sliding_window_pattern
    != 0 (4 by default; a pattern string such as "LLLG" comes with layer_types in the
    checkpoints). Its global layers run without RoPE: no parameters either way."""
    mapping = _base(c, tied=False) | {"bias": False, "qk_norm": True}
    mapping["_notes"] = [_POST_NORM_NOTE]
    rule = None
    if c.data.get("sliding_window", 4096) and c.get("layer_types") is None:
        pattern = c.get("sliding_window_pattern", 4)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise c.refuse(
                "sliding_window_pattern",
                f"{quote(pattern)} without layer_types: a positive integer, every pattern-th "
                "layer global",
            )

        def rule(i: int) -> bool:
            return (i + 1) % pattern != 0

    return mapping | _windows(c, mapping["layers"], rule, default_window=4096)


def _minimax_m2(c: _Config) -> dict[str, Any]:
    """MiniMax-M2 (MiniMaxM2ForCausalLM, modeling_minimax_m2.py v5.25.0): attention without
    biases, head_dim 128 by default, QK norms over all heads (q_norm of a·d, k_norm of g·d:
    qk_norm_width full, built whatever use_qk_norm says); in every layer num_local_experts
    experts of intermediate_size, top num_experts_per_tok, routed by sigmoid scores with a
    per-expert correction bias (e_score_correction_bias, a buffer the checkpoint holds:
    expert_bias), no shared expert. Its partial rotary holds no parameters; the checkpoint's
    multi-token-prediction modules (use_mtp), which transformers does not build, are noted."""
    mapping = _base(c, tied=False, head_dim=128) | {"bias": False}
    mapping |= {
        "qk_norm": True,
        "qk_norm_width": "full",
        "experts": _every_layer_experts(c, "num_local_experts", 256),
        "top_k": c.get("num_experts_per_tok", 8),
        "expert_bias": True,
    }
    modules = c.get("num_mtp_modules", 0) if c.flag("use_mtp", False) else 0
    if modules:
        mapping["_notes"] = [
            f"its {modules} multi-token-prediction module(s) (use_mtp) not counted: transformers "
            "does not build them"
        ]
    return mapping


def _gemma(c: _Config) -> dict[str, Any]:
    return {**_base(c, tied=True, head_dim=256), **_llama_biases(c)}


def _gemma2(c: _Config) -> dict[str, Any]:
    mapping = {**_gemma(c), "post_norms": True}
    # Gemma2DecoderLayer: sliding on the even layers, (i + 1) % 2 != 0.
    return mapping | _windows(c, mapping["layers"], lambda i: i % 2 == 0, default_window=4096)


def _gemma3_text(c: _Config) -> dict[str, Any]:
    # Gemma3TextConfig's defaults for the keys gemma-3-4b-it's sparse text_config leaves out.
    defaults = {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4,
                "max_position_embeddings": 131_072, "sliding_window": 4096}  # fmt: skip
    given = {key: value for key, value in c.data.items() if value is not None}
    c = _Config(defaults | given, c.origin, c.model_type)
    mapping = {**_gemma(c), "post_norms": True, "qk_norm": True}
    # Gemma3TextConfig: every sliding_window_pattern-th layer global, (i + 1) % 6 == 0.
    pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6))
    windows = _windows(c, mapping["layers"], lambda i: (i + 1) % pattern != 0)
    return mapping | windows


def _granite(c: _Config) -> dict[str, Any]:
    """Granite 3.x: Llama's layer. Its embedding_multiplier, attention_multiplier,
    residual_multiplier and logits_scaling are scalars (GraniteModel, GraniteDecoderLayer,
    modeling_granite.py, transformers v5.25.0): no parameters, no tensor saved."""
    return _llama(c)


def _granitemoe(c: _Config) -> dict[str, Any]:
    """Granite 3.x MoE (GraniteMoeForCausalLM, modeling_granitemoe.py v5.25.0): Granite's
    attention (its multipliers scalars) and in every layer num_local_experts experts of
    intermediate_size, top num_experts_per_tok, a router without bias; with
    GraniteMoeShared's shared_intermediate_size > 0 one shared SwiGLU MLP that wide, ungated.
    attention_bias biases Q, K, V and O but not the experts, a layout ckplan's bias keys do not
    hold: refused."""
    _refuse_bias_without_experts(c, "attention_bias", "Q, K, V and O")
    mapping = _base(c, tied=False) | {"bias": False}
    mapping |= {
        "experts": _every_layer_experts(c, "num_local_experts", 8),
        "top_k": c.get("num_experts_per_tok", 2),
    }
    shared = c.get("shared_intermediate_size", 0) if c.model_type == "granitemoeshared" else 0
    if shared:
        mapping |= {"shared_experts": 1, "shared_ffn_hidden": shared}
    return mapping


def _smollm3(c: _Config) -> dict[str, Any]:
    """SmolLM3: Llama's layer, the embeddings tied by default, every no_rope_layer_interval-th
    layer without RoPE (no parameters either way) and, with use_sliding_window, the window on
    those NoPE layers (SmolLM3Config.__post_init__, configuration_smollm3.py v5.25.0)."""
    mapping = {**_base(c, tied=True), **_llama_biases(c)}
    if not c.flag("use_sliding_window", False):
        return mapping
    layers = _capped(mapping["layers"])
    interval = c.get("no_rope_layer_interval", 4)
    rope = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    return mapping | _windows(c, layers, lambda i: i < len(rope) and not rope[i])


def _glm4(c: _Config) -> dict[str, Any]:
    """GLM-4 (0414): Q, K and V with biases (attention_bias, default true), o_proj and the MLP
    without; a norm after attention and after the MLP beside the two before them
    (post_self_attn_layernorm, post_mlp_layernorm: Glm4DecoderLayer, modeling_glm4.py
    v5.25.0), Gemma 2's four; head_dim 128 by default. Its partial rotary factor changes
    nothing ckplan counts."""
    mapping = _base(c, tied=False, head_dim=128)
    return mapping | {"qkv_bias": c.flag("attention_bias", True), "post_norms": True}


def _glm4_moe(c: _Config) -> dict[str, Any]:
    """GLM-4.5 / 4.6 (Glm4MoeForCausalLM, modeling_glm4_moe.py v5.25.0): Q, K, V biases with
    attention_bias, o_proj without; per-head QK norms with use_qk_norm; the first
    first_k_dense_replace layers dense, the rest n_routed_experts routed experts of
    moe_intermediate_size and one shared MLP of n_shared_experts × that width; a sigmoid
    router with a per-expert correction bias (e_score_correction_bias, in the checkpoint),
    group-limited by n_group/topk_group. Its multi-token-prediction layers are not built by
    transformers: noted, as for DeepSeek-V3."""
    mapping = _base(c, tied=False)
    mapping |= {
        "qkv_bias": c.flag("attention_bias", False),
        "qk_norm": c.flag("use_qk_norm", False),
    }
    layers = _capped(mapping["layers"])
    first_dense = c.get("first_k_dense_replace", 1)
    if first_dense >= layers:  # every layer dense: Glm4MoeMLP of intermediate_size
        return mapping | {"_notes": _mtp_notes(c)}
    mapping |= {
        "experts": c.get("n_routed_experts", 128),
        "top_k": c.get("num_experts_per_tok", 8),
        "moe_ffn_hidden": c.get("moe_intermediate_size", 1408),
        "moe_layers": _moe_layers(layers, {i for i in range(layers) if i >= first_dense}),
        "shared_experts": c.get("n_shared_experts", 1),
        "expert_bias": True,
    }
    return mapping | _router_groups(c) | {"_notes": _mtp_notes(c)}


def _no_mlp_bias(c: _Config) -> dict[str, Any]:
    """OLMo 2/3 and OLMoE: attention_bias biases Q, K, V and O; their MLP has none, a layout
    ckplan's two bias keys do not hold (the published checkpoints set false)."""
    if c.flag("attention_bias", False):
        raise c.refuse(
            "attention_bias",
            "biases on Q, K, V and O without MLP biases: ckplan's biases are on every linear "
            "layer (bias) or on Q, K, V only (qkv_bias)",
        )
    return {"bias": False}


_POST_NORM_NOTE = (
    "its two norms follow attention and the MLP instead of preceding them: the same weights "
    "and saved tensors, counted as pre-norms"
)


def _olmo2(c: _Config) -> dict[str, Any]:
    """OLMo 2 (Olmo2DecoderLayer, modeling_olmo2.py v5.25.0): RMSNorm after attention and after
    the MLP, none before (`_POST_NORM_NOTE`), and QK-norms over all heads together (q_norm of
    a·d, k_norm of g·d: qk_norm_width full)."""
    mapping = {**_base(c, tied=False), **_no_mlp_bias(c)}
    return mapping | {"qk_norm": True, "qk_norm_width": "full", "_notes": [_POST_NORM_NOTE]}


def _olmo3(c: _Config) -> dict[str, Any]:
    """OLMo 3: OLMo 2's layer with a 4,096-token window on three layers of four, (i + 1) % 4
    != 0, unless layer_types says otherwise (Olmo3Config, configuration_olmo3.py v5.25.0)."""
    mapping = _olmo2(c)
    windows = _windows(c, mapping["layers"], lambda i: (i + 1) % 4 != 0, default_window=4096)
    return mapping | windows


def _olmoe(c: _Config) -> dict[str, Any]:
    """OLMoE (OlmoeDecoderLayer, modeling_olmoe.py v5.25.0): Llama's pre-norm layer with
    QK-norms over all heads (q_norm of h, k_norm of (h/a)·g) and, in every layer,
    num_experts experts of intermediate_size with top-k routing, no shared expert and no
    router bias. clip_qkv clamps Q, K and V in place: nothing saved."""
    mapping = {**_base(c, tied=False), **_no_mlp_bias(c)}
    mapping.pop("head_dim", None)  # OlmoeAttention: head_dim is h/a
    return mapping | {
        "qk_norm": True,
        "qk_norm_width": "full",
        "experts": _every_layer_experts(c, "num_experts", 64),
        "top_k": c.get("num_experts_per_tok", 8),
    }


def _refuse_bias_without_experts(c: _Config, key: str, biased: str) -> None:
    """A bias key that biases `biased` but not the experts: a layout ckplan's bias keys (every
    linear layer, or Q, K and V only) do not hold."""
    if c.flag(key, False):
        raise c.refuse(
            key,
            f"biases on {biased} but none on the experts: ckplan's biases are on every linear "
            "layer (bias) or on Q, K, V only (qkv_bias)",
        )


def _every_layer_experts(c: _Config, key: str, default: int) -> Any:
    """The experts of a family whose every MLP is a mixture of experts (no dense MLP to fall
    back on): at least one."""
    experts = c.get(key, default)
    if experts == 0:
        raise c.refuse(key, f"0: every {c.model_type} MLP is a mixture of experts")
    return experts


def _gpt_oss(c: _Config) -> dict[str, Any]:
    """gpt-oss (GptOssForCausalLM, modeling_gpt_oss.py v5.25.0): Q, K, V and O with biases
    (attention_bias, default true), an attention sink per head, a 128-token window on the even
    layers ((i + 1) % 2 != 0) unless layer_types says otherwise, and in every layer
    num_local_experts experts of intermediate_size with biases on both projections, routed by
    a linear with a bias: ckplan's `bias` counts each of them. Its clamped SwiGLU (swiglu_limit,
    swiglu_alpha) saves what SwiGLU saves here. head_dim 64 by default."""
    if not c.flag("attention_bias", True):
        raise c.refuse(
            "attention_bias",
            "false leaves the experts' and the router's biases, a layout ckplan's bias keys "
            "do not hold",
        )
    mapping = {**_base(c, tied=False, head_dim=64), "bias": True, "attention_sinks": True}
    windows = _windows(c, mapping["layers"], lambda i: (i + 1) % 2 != 0, default_window=128)
    return (
        mapping
        | windows
        | {
            "experts": _every_layer_experts(c, "num_local_experts", 128),
            "top_k": c.get("num_experts_per_tok", 4),
            "_notes": [
                "attention sinks: transformers has no SDPA kernel for them (eager, flex or a "
                "sink-aware flash kernel); attention: standard for its eager path"
            ],
        }
    )


def _phi3(c: _Config) -> dict[str, Any]:
    mapping = {**_base(c, tied=False), **_llama_biases(c)}  # fused qkv_proj and gate_up_proj
    return mapping | _windows(c, mapping["layers"], None)


def _gpt2(c: _Config) -> dict[str, Any]:
    if c.flag("add_cross_attention", False):
        raise c.refuse("add_cross_attention", "a decoder-only layer has no cross-attention")
    hidden = c.need("n_embd")
    return {
        "layers": c.need("n_layer"),
        "hidden": hidden,
        "heads": c.need("n_head"),
        "ffn_hidden": c.get("n_inner", 4 * hidden),
        "vocab": c.need("vocab_size"),
        "seq": c.need("n_positions"),
        "micro_batch": 1,
        "dtype_bytes": TRAINING_DTYPE_BYTES,
        "norm": "layernorm",
        "mlp": "gelu",
        "attention": "standard",
        "positions": "learned",
        "bias": True,
        "dropout": c.get("attn_pdrop", 0.1),
        "tied_embeddings": c.flag("tie_word_embeddings", True),
    }


def _gpt_neox(c: _Config) -> dict[str, Any]:
    if not c.flag("attention_bias", True):
        raise c.refuse(
            "attention_bias", "GPT-NeoX's MLP keeps its biases; ckplan's are all or none"
        )
    mapping = _base(c, tied=False)
    return mapping | {
        "norm": "layernorm",
        "mlp": "gelu",
        "bias": True,
        "parallel_residual": c.flag("use_parallel_residual", True),
        "dropout": c.get("attention_dropout", 0.0) or 0.0,
    }


def _deepseek(c: _Config) -> dict[str, Any]:
    """DeepSeek-V2/V3: MLA, a dense first_k_dense_replace, then MoE every moe_layer_freq-th
    layer (DeepseekV2DecoderLayer), shared experts of n_shared_experts × moe_intermediate_size;
    V3's noaux_tc routing adds a per-expert bias (e_score_correction_bias). A key the file leaves
    out takes its config class's default (`_DEEPSEEK_DEFAULTS`); q_lora_rank null is no query
    latent."""
    q_lora_rank = c.data.get("q_lora_rank", 1536)  # present and null: no query latent
    c = _Config({**_DEEPSEEK_DEFAULTS[c.model_type], **c.data}, c.origin, c.model_type)
    mapping = {**_base(c, tied=False), **_llama_biases(c)}
    mapping.pop("head_dim", None)
    layers = _capped(mapping["layers"])
    mapping |= {
        "q_lora_rank": q_lora_rank or 0,
        "kv_lora_rank": c.need("kv_lora_rank"),
        "qk_nope_head_dim": c.need("qk_nope_head_dim"),
        "qk_rope_head_dim": c.need("qk_rope_head_dim"),
        "v_head_dim": c.need("v_head_dim"),
    }
    experts = c.get("n_routed_experts", 0)
    if experts:
        first_dense, freq = c.get("first_k_dense_replace", 0), c.get("moe_layer_freq", 1)
        moe = {i for i in range(layers) if i >= first_dense and i % freq == 0}
        shared = c.get("n_shared_experts", 0)
        mapping |= {
            "experts": experts,
            "top_k": c.need("num_experts_per_tok"),
            "moe_ffn_hidden": c.need("moe_intermediate_size"),
            "moe_layers": _moe_layers(layers, moe),
            "shared_experts": shared,
            "expert_bias": c.model_type == "deepseek_v3" or c.get("topk_method") == "noaux_tc",
        }
        mapping |= _router_groups(c)
    return mapping | {"_notes": _mtp_notes(c)}


# DeepseekV2Config and DeepseekV3Config's defaults for the keys the MLA and MoE layers read
# (configuration_deepseek_v2.py, configuration_deepseek_v3.py, transformers v5.25.0); V2's
# num_experts_per_tok has none (None), so a file without it is an error.
_DEEPSEEK_DEFAULTS = {
    "deepseek_v2": {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
                    "moe_intermediate_size": 1407, "first_k_dense_replace": 0},
    "deepseek_v3": {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                    "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
                    "num_experts_per_tok": 8},
}  # fmt: skip


def _mtp_notes(c: _Config, mtp: Any = None) -> list[str]:
    """The checkpoint's multi-token-prediction layers (`mtp`, by default
    num_nextn_predict_layers): whether a run trains them is the run's choice (Hugging Face
    transformers does not build them; Megatron's --mtp-num-layers)."""
    mtp = c.get("num_nextn_predict_layers", 0) if mtp is None else mtp
    if not mtp:
        return []
    return [
        f"its {mtp} multi-token-prediction layer(s) (num_nextn_predict_layers) not trained "
        f"here: set mtp_layers={mtp} for a run that trains them"
    ]


def _router_groups(c: _Config) -> dict[str, Any]:
    """Group-limited routing (ckplan's moe_router_num_groups, moe_router_group_topk), as
    Megatron-Bridge maps n_group and topk_group (src/megatron/bridge/models/deepseek/common.py
    at bf71eba). Hugging Face transformers 5.25: DeepseekV3TopkRouter and Glm4MoeTopkRouter
    always route within topk_group of n_group groups (defaults 8 and 4; 1 and 1); DeepseekV2
    only with topk_method group_limited_greedy (its defaults None). One group is no limit."""
    if c.model_type in _ROUTER_GROUPS:
        default_groups, default_chosen = _ROUTER_GROUPS[c.model_type]
        groups, chosen = c.get("n_group", default_groups), c.get("topk_group", default_chosen)
    elif c.get("topk_method") == "group_limited_greedy":
        groups, chosen = c.need("n_group"), c.need("topk_group")
    else:
        return {}
    if groups <= 1:
        return {}
    return {"moe_router_num_groups": groups, "moe_router_group_topk": chosen}


_ROUTER_GROUPS = {"deepseek_v3": (8, 4), "glm4_moe": (1, 1)}  # (n_group, topk_group) defaults


_FAMILIES: dict[str, Callable[[_Config], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3_text,  # a text-only gemma3 config (the multimodal one: text_config)
    "gemma3_text": _gemma3_text,
    "phi3": _phi3,
    "granite": _granite,
    "smollm3": _smollm3,
    "glm4": _glm4,
    "glm4_moe": _glm4_moe,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "olmo2": _olmo2,
    "olmo3": _olmo3,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "ministral": _ministral,
    "ministral3": _ministral3,
    "seed_oss": _seed_oss,
    "ernie4_5": _ernie4_5,
    "helium": _helium,
    "starcoder2": _starcoder2,
    "exaone4": _exaone4,
    "minimax_m2": _minimax_m2,
    "ernie4_5_moe": _ernie4_5_moe,
    "granitemoe": _granitemoe,
    "granitemoeshared": _granitemoe,
    "hunyuan_v1_dense": _hunyuan_dense,
}
# Text models read only inside their multimodal config (`_TEXT_TOWERS`).
_TOWER_FAMILIES: dict[str, Callable[[_Config], dict[str, Any]]] = {
    "qwen2_vl_text": _qwen2_vl_text,
    "qwen2_5_vl_text": _qwen2_vl_text,
    "qwen3_vl_text": _qwen3_vl_text,
    "qwen3_vl_moe_text": _qwen3_vl_moe_text,
}
SUPPORTED = (*_FAMILIES, *(outer for outer in _TEXT_TOWERS if outer not in _FAMILIES))
