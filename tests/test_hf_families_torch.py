"""Every config.json fixture (tests/fixtures/hf) against the model Hugging Face transformers
builds from it: ckplan's parameter count equals the parameters of `AutoModelForCausalLM
.from_config` (on the meta device, no memory) plus its persistent buffers, the tensors a
checkpoint holds (DeepSeek-V3's and GLM-4.5's e_score_correction_bias are buffers there).
Gemma 3's multimodal config is built from its text_config, the part ckplan counts."""

import json
import warnings
from pathlib import Path

import pytest
from needs_frameworks import framework_or_skip

from ckplan.inputs.hf_config import SUPPORTED, hf_config_mapping
from ckplan.inputs.presets import load_spec
from ckplan.model.memory import frozen_weight_bytes, parameter_count

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


# The multimodal model_types: their language model is the ForConditionalGeneration model's.
# Qwen2-VL's and Qwen2.5-VL's files may keep the text keys at the top, without text_config.
FLAT_MULTIMODAL = {"qwen2_vl", "qwen2_5_vl"}
MULTIMODAL = {"gemma3", "mistral3", "qwen3_vl", "qwen3_vl_moe", *FLAT_MULTIMODAL}


def multimodal(config: dict) -> bool:
    """A multimodal file: a text_config, or a Qwen2-VL file whose text keys sit at the top."""
    return "text_config" in config or config.get("model_type") in FLAT_MULTIMODAL


def built_model(config: dict, why: str, lora_targets=None):
    """The model transformers builds from `config` on the meta device (no memory): the
    ForConditionalGeneration model of a multimodal file; with `lora_targets`, under PEFT's LoRA
    r 8 on them. `why`: what a missing framework leaves unchecked."""
    torch = framework_or_skip("torch", why)
    transformers = framework_or_skip("transformers", why)
    auto = transformers.AutoModelForCausalLM
    if multimodal(config):
        auto = transformers.AutoModelForImageTextToText
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = auto.from_config(transformers.AutoConfig.for_model(**config))
        if lora_targets is not None:
            peft = framework_or_skip("peft", why)
            model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=lora_targets))
    return model


def checkpoint_tensors(config: dict) -> int:
    """The language model's tensors: of a multimodal config (a text_config) the
    ForConditionalGeneration model's language model and output layer, tied or not as that
    model ties them, without the vision tower and projector."""
    model = built_model(config, "the parameter counts were not checked")
    parts = [model]
    if multimodal(config):
        parts = [model.model.language_model, model.lm_head]
    parameters = {id(p): p for part in parts for p in part.parameters()}  # tied weights once
    buffers = 0
    for part in parts:
        saved = set(part.state_dict())
        buffers += sum(b.numel() for name, b in part.named_buffers() if name in saved)
    return sum(p.numel() for p in parameters.values()) + buffers


@pytest.mark.parametrize("name", sorted(p.parent.name for p in FIXTURES.glob("*/config.json")))
def test_parameters_equal_what_transformers_builds(name):
    path = FIXTURES / name / "config.json"
    expected = checkpoint_tensors(json.loads(path.read_text()))
    assert parameter_count(load_spec(str(path), {})).total == expected


# The keys a config.json cannot leave out, small; every other key takes its config class's
# default, in ckplan as in transformers (grouped-query heads, head_dim, MLA ranks, experts).
MINIMAL = {
    "vocab_size": 160_000, "hidden_size": 2048, "num_attention_heads": 32, "num_hidden_layers": 4,
    "intermediate_size": 4096, "max_position_embeddings": 4096,
}  # fmt: skip
MINIMAL_BY_FAMILY = {
    "gpt2": {
        "vocab_size": 160_000,
        "n_layer": 4,
        "n_embd": 2048,
        "n_head": 32,
        "n_positions": 4096,
    },
    # DeepseekV2Config has no num_experts_per_tok default; V3's 8 router groups (top-4 of them)
    # need 8 experts each
    "deepseek_v2": MINIMAL | {"n_routed_experts": 8, "num_experts_per_tok": 2},
    "deepseek_v3": MINIMAL | {"n_routed_experts": 64, "moe_intermediate_size": 256},
    # MinistralConfig keeps head_dim None, which MinistralAttention then cannot use
    # (transformers v5.25.0: `self.head_dim**-0.5` on None); ckplan reads h/a
    "ministral": MINIMAL | {"head_dim": 64},
    "hunyuan_v1_dense": MINIMAL | {"head_dim": 64},  # the same: head_dim None in its config
    # Helium's o_proj is hidden x hidden, so its heads span h; its 20 key/value heads by default
    "helium": MINIMAL | {"hidden_size": 2560, "num_attention_heads": 40, "head_dim": 64},
}


@pytest.mark.parametrize("model_type", sorted(set(SUPPORTED) - MULTIMODAL))
def test_a_key_left_out_takes_the_config_class_default(model_type, tmp_path):
    """The multimodal configs hold their language model in text_config: tested below."""
    config = {**MINIMAL_BY_FAMILY.get(model_type, MINIMAL), "model_type": model_type}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert parameter_count(load_spec(str(path), {})).total == checkpoint_tensors(config)


@pytest.mark.parametrize(
    "outer, inner, top",
    [
        ("gemma3", "gemma3_text", {}),
        ("mistral3", "mistral", {}),
        ("mistral3", "ministral3", {}),
        ("mistral3", "mistral", {"tie_word_embeddings": False}),
        ("qwen3_vl", "qwen3_vl_text", {}),
        ("qwen3_vl", "qwen3_vl_text", {"tie_word_embeddings": True}),
        ("qwen3_vl_moe", "qwen3_vl_moe_text", {}),
        ("qwen2_vl", "qwen2_vl_text", {}),
        ("qwen2_5_vl", "qwen2_5_vl_text", {"tie_word_embeddings": True}),
    ],
)
def test_a_multimodal_language_model_is_what_transformers_builds(outer, inner, top, tmp_path):
    """The text model's keys left out take its config class's defaults; the outer file's
    tie_word_embeddings (or its class default: Mistral3Config's true, Qwen3-VL's false) ties
    the output layer, whatever text_config says."""
    tied = top.get("tie_word_embeddings", outer in ("gemma3", "mistral3"))
    text = MINIMAL | {"model_type": inner, "tie_word_embeddings": not tied}
    if outer in FLAT_MULTIMODAL:  # a text_config that ties ties these (pre-v5 files)
        text["tie_word_embeddings"] = True
    config = {"model_type": outer, "text_config": text, **top}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = load_spec(str(path), {})
    assert parameter_count(spec).total == checkpoint_tensors(config)
    assert "vision tower" in spec.source


@pytest.mark.parametrize("outer", sorted(FLAT_MULTIMODAL))
@pytest.mark.parametrize("tie", [None, True, False])
def test_a_flat_qwen2_vl_file_is_its_language_model(outer, tie, tmp_path):
    """Qwen2-VL and Qwen2.5-VL hub files keep the text model's keys at the top level, which
    the config turns into its text_config."""
    config = {"model_type": outer, **MINIMAL, "vision_config": {"depth": 1}}
    if tie is not None:
        config["tie_word_embeddings"] = tie
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = load_spec(str(path), {})
    assert parameter_count(spec).total == checkpoint_tensors(config)
    assert spec.tied_embeddings is bool(tie) and spec.qkv_bias


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_FIXTURES = [
    "GLM-4.5-Air",
    "Mixtral-8x7B-v0.1",
    "Qwen1.5-MoE-A2.7B",
    "Qwen3-30B-A3B",
    "gpt-oss-20b",
    "olmoe-config-defaults",
    "minimax-m2-config-defaults",
    "qwen3-vl-moe-config-defaults",
    "ernie4_5-moe-config-defaults",
]


def peft_trainable(config: dict, target_modules) -> int:
    """The trainable parameters PEFT gives the model transformers builds from `config` (on the
    meta device) under LoRA r 8 on `target_modules`."""
    model = built_model(config, "the adapter counts were not checked", target_modules)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["mistral3-config-defaults", "gemma-3-4b-it"])
def test_adapters_on_a_multimodal_checkpoint_equal_peft_on_its_language_model(name):
    """ckplan's LoRA on q_proj and v_proj of a multimodal checkpoint is PEFT's on the language
    model's projections (a regex naming language_model); PEFT's plain names also adapt the
    vision tower's like-named projections (Pixtral's, SigLIP's), which ckplan does not count."""
    config = json.loads((FIXTURES / name / "config.json").read_text())
    keys = {"training": "lora", "lora_rank": 8, "lora_targets": "q_proj,v_proj"}
    spec = load_spec(str(FIXTURES / name / "config.json"), keys)
    trainable = parameter_count(spec).trainable
    assert trainable == peft_trainable(config, r".*language_model.*\.(q_proj|v_proj)")
    assert trainable < peft_trainable(config, ["q_proj", "v_proj"])


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_attention_adapters_on_a_mixture_of_experts_equal_peft(name):
    """LoRA on the attention projections of an MoE checkpoint: ckplan's trainable parameters
    are PEFT's, and its frozen weights every other parameter."""
    config = json.loads((FIXTURES / name / "config.json").read_text())
    keys = {"training": "lora", "lora_rank": 8, "lora_targets": ",".join(ATTENTION)}
    spec = load_spec(str(FIXTURES / name / "config.json"), keys)
    counts = parameter_count(spec)
    assert counts.trainable == peft_trainable(config, ATTENTION)
    assert frozen_weight_bytes(spec, 0, 2) == (2 * counts.total, 0)  # the experts' among them


def test_all_linear_adapts_more_than_attention_on_mixtral_not_on_gpt_oss():
    """Why `lora_targets` names attention projections only beside experts: on Mixtral PEFT's
    all-linear adapts the router and the experts' 3D weights too (target_parameters, which
    ckplan does not model), while on gpt-oss it is the attention projections alone."""
    mixtral = json.loads((FIXTURES / "Mixtral-8x7B-v0.1" / "config.json").read_text())
    mixtral |= {"num_hidden_layers": 2}
    assert peft_trainable(mixtral, "all-linear") > peft_trainable(mixtral, ATTENTION)
    gpt_oss = json.loads((FIXTURES / "gpt-oss-20b" / "config.json").read_text())
    gpt_oss |= {"num_hidden_layers": 2, "layer_types": gpt_oss["layer_types"][:2]}
    assert peft_trainable(gpt_oss, "all-linear") == peft_trainable(gpt_oss, ATTENTION)


@pytest.mark.parametrize(
    "model_type, keys",
    [
        ("qwen2", {}),
        ("qwen2", {"max_window_layers": 2}),
        ("qwen3", {"num_hidden_layers": 32}),
        ("qwen2_moe", {"max_window_layers": 3}),
        ("qwen2_moe", {"num_hidden_layers": 32}),
        ("qwen2_5_vl", {"max_window_layers": 1}),
        ("ministral", {"head_dim": 64}),
        ("exaone4", {}),
        ("exaone4", {"sliding_window_pattern": 2}),
    ],
)
def test_sliding_layers_are_the_ones_transformers_configures(model_type, keys, tmp_path):
    """The layers ckplan slides on are those the config class marks sliding_attention in
    layer_types (v5.25.0), from use_sliding_window, max_window_layers and the family's rule,
    the window 4,096 wide where the file gives none."""
    transformers = framework_or_skip("transformers", "the sliding layers were not checked")
    from ckplan.model.layers import parse_layer_set

    config = {**MINIMAL, "model_type": model_type, "use_sliding_window": True, **keys}
    configured = transformers.AutoConfig.for_model(**config)
    text = configured.get_text_config()
    expected = {i for i, kind in enumerate(text.layer_types) if kind == "sliding_attention"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = load_spec(str(path), {})
    layers = spec.layers
    sliding = parse_layer_set(spec.sliding_window_layers, layers) if spec.sliding_window else set()
    assert sliding == expected
    assert not expected or spec.sliding_window == text.sliding_window == 4096


def test_qwen3_moe_slides_on_every_layer():
    """Qwen3-MoE's attention takes config.sliding_window in every layer (v5.25.0: its config
    has no layer_types): with use_sliding_window, all of them."""
    transformers = framework_or_skip("transformers", "the sliding layers were not checked")
    config = {**MINIMAL, "model_type": "qwen3_moe", "use_sliding_window": True}
    assert transformers.AutoConfig.for_model(**config).sliding_window == 4096
    mapping = hf_config_mapping(config, "x")
    assert (mapping["sliding_window"], mapping["sliding_window_layers"]) == (4096, "all")
