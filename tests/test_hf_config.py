"""Hugging Face config.json of each supported family (real files, tests/fixtures/hf/) against
the published parameter totals, and the keys ckplan refuses."""

import json
from pathlib import Path

import pytest

from ckplan.inputs.hf_config import SUPPORTED, hf_config_mapping
from ckplan.inputs.presets import load_spec
from ckplan.model.layers import layer_kinds
from ckplan.model.memory import parameter_count
from ckplan.model.spec import SpecError, spec_from_mapping

FIXTURES = Path(__file__).parent / "fixtures" / "hf"

# Published totals: the checkpoints' safetensors parameter counts (the HF model pages' "Model
# size"), as also quoted by keras-hub presets and model cards.
PUBLISHED = {
    "Meta-Llama-3-8B": 8_030_261_248,
    "Mistral-7B-v0.1": 7_241_732_096,
    "Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen2-7B": 7_615_616_512,  # with the q, k, v biases
    "Qwen1.5-MoE-A2.7B": 14_315_784_192,
    "Qwen3-8B": 8_190_735_360,
    "Qwen3-30B-A3B": 30_532_122_624,
    "gemma-7b": 8_537_680_896,
    "gemma-2-9b": 9_241_705_984,
    "Phi-3-mini-4k-instruct": 3_821_079_552,
    "gpt2": 124_439_808,
    "pythia-160m": 162_322_944,  # gpt_neox
    "DeepSeek-V2-Lite": 15_706_484_224,
    # GLM-4.5-Air: "106B total parameters" (zai-org/GLM-4.5 README), the main model's 46
    # layers without the MTP layer the checkpoint adds; transformers v5.25.0 builds the same
    # count (tests/test_hf_families_torch.py)
    "GLM-4.5-Air": 106_852_251_264,
    "SmolLM3-3B": 3_075_098_624,  # "3.08B params" (the model page), tied embeddings
    # the gpt-oss model card (OpenAI, 2025): "20.91B" total for gpt-oss-20b
    "gpt-oss-20b": 20_914_757_184,
    # the checkpoint's model.safetensors.index.json: total_size 54,864,793,600 bytes in fp32
    "OLMo-2-1124-13B": 54_864_793_600 // 4,
}


def load(name, **overrides):
    return load_spec(str(FIXTURES / name / "config.json"), overrides)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameters_equal_the_published_total(name):
    assert parameter_count(load(name)).total == PUBLISHED[name]


def test_every_supported_family_has_a_fixture():
    types = set()
    for path in FIXTURES.glob("*/config.json"):
        types.add(json.loads(path.read_text())["model_type"])
    assert types >= set(SUPPORTED) - {"gemma3_text"}


def test_deepseek_v3_671b_main_model():
    """DeepSeek-V3: 671B total (README_WEIGHTS.md: "Main Model Weights ... Total parameters:
    671B"), the 61 layers, embedding and output head; the MTP module (11.5B unique) is not
    counted, and the source says so. Activated 36.6B without the input embedding."""
    spec = load("DeepSeek-V3")
    counts = parameter_count(spec)
    assert counts.total == 671_026_419_200
    assert round(counts.total / 1e9) == 671
    assert round((counts.active - spec.vocab * spec.hidden) / 1e8) == 366
    assert "multi-token-prediction" in spec.source
    assert spec.expert_bias and spec.moe_layers == "3-" and spec.q_lora_rank == 1536


def test_gemma3_text_config_with_the_vision_tower():
    """gemma-3-4b-it: ckplan counts the language model (text_config, with Gemma3TextConfig's
    defaults for the keys the file leaves out); adding the SigLIP vision tower and projector,
    derived here from vision_config, gives the published 4,300,079,472."""
    config = json.loads((FIXTURES / "gemma-3-4b-it" / "config.json").read_text())
    spec = load("gemma-3-4b-it")
    text = parameter_count(spec).total
    v = config["vision_config"]
    d, f, n = v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"]
    patches = (v["image_size"] // v["patch_size"]) ** 2
    vision = 3 * v["patch_size"] ** 2 * d + d + patches * d  # patch conv and positions
    vision += n * (4 * (d * d + d) + 2 * d * f + f + d + 2 * 2 * d) + 2 * d  # layers, post-LN
    projector = d * spec.hidden + d  # mm_input_projection and mm_soft_emb_norm
    assert text + vision + projector == 4_300_079_472
    assert "vision tower" in spec.source
    assert (spec.vocab, spec.heads, spec.kv_heads, spec.head_dim) == (262_208, 8, 4, 256)
    assert spec.qk_norm and spec.post_norms and spec.tied_embeddings
    windows = [kind.window for kind in layer_kinds(spec.replace(seq=8192))]
    assert windows[:6] == [1024] * 5 + [0]


def test_mixtral_is_a_mixture_of_experts_not_a_dense_7b():
    spec = load("Mixtral-8x7B-v0.1")
    assert (spec.experts, spec.top_k, spec.moe_ffn_hidden) == (8, 2, 14336)
    assert parameter_count(spec).total > 46e9


def test_family_quirks():
    assert load("Qwen2-7B").qkv_bias and not load("Qwen2-7B").bias
    qwen3 = load("Qwen3-8B")
    assert qwen3.qk_norm and qwen3.head_dim == 128
    moe = load("Qwen1.5-MoE-A2.7B")
    assert (moe.shared_ffn_hidden, moe.shared_expert_gate, moe.qkv_bias) == (5632, True, True)
    gemma2 = load("gemma-2-9b")
    assert gemma2.post_norms and gemma2.sliding_window_layers == "0-:2"
    assert gemma2.mlp == "geglu" and gemma2.tied_embeddings and gemma2.dtype_bytes == 2
    assert "stored in float32: planned as bf16 mixed-precision training" in gemma2.source
    assert load("Mistral-7B-v0.1").sliding_window == 4096
    assert load("Phi-3-mini-4k-instruct").sliding_window == 2047
    neox = load("pythia-160m")
    assert neox.parallel_residual and neox.norm == "layernorm" and not neox.tied_embeddings
    lite = load("DeepSeek-V2-Lite")
    assert (lite.q_lora_rank, lite.moe_layers, lite.shared_ffn_hidden) == (0, "1-", 2816)
    assert not lite.expert_bias


def test_glm4_moe_air():
    """GLM-4.5-Air: 128 routed experts from layer 1 on, one shared, a correction bias per
    expert; Q, K, V biased and o_proj not; 96 heads of 128 (a·d = 12,288 != h); 12B active
    (zai-org/GLM-4.5 README: "106B total parameters and 12B active"), which counts neither
    the input embedding nor the output layer."""
    spec = load("GLM-4.5-Air")
    assert (spec.experts, spec.top_k, spec.moe_ffn_hidden, spec.moe_layers) == (128, 8, 1408, "1-")
    assert (spec.shared_experts, spec.shared_ffn_hidden, spec.expert_bias) == (1, 1408, True)
    assert spec.qkv_bias and not spec.bias and not spec.qk_norm and spec.head_dim == 128
    assert spec.moe_router_num_groups == 0  # n_group 1: no group limit
    counts = parameter_count(spec)
    assert round((counts.active - 2 * spec.vocab * spec.hidden) / 1e9) == 12
    assert "multi-token-prediction" in spec.source


def test_glm4_moe_options():
    config = json.loads((FIXTURES / "GLM-4.5-Air" / "config.json").read_text())
    changes = {"use_qk_norm": True, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4}
    mapping = hf_config_mapping({**config, **changes}, "x/config.json")
    assert mapping["qk_norm"] and mapping["moe_layers"] == "3-"
    assert (mapping["moe_router_num_groups"], mapping["moe_router_group_topk"]) == (8, 4)


def test_glm4_dense_has_four_norms_and_qkv_biases():
    spec = load("glm4-config-defaults")
    assert spec.post_norms and spec.qkv_bias and not spec.bias and spec.head_dim == 128


def test_smollm3_windows_sit_on_its_nope_layers():
    """SmolLM3Config.__post_init__ (v5.25.0): with use_sliding_window, the layers without RoPE
    (every no_rope_layer_interval-th, or the zeros of no_rope_layers) slide."""
    spec = load("SmolLM3-3B")
    assert spec.tied_embeddings and spec.sliding_window == 0
    config = json.loads((FIXTURES / "SmolLM3-3B" / "config.json").read_text())
    windowed = {**config, "use_sliding_window": True, "sliding_window": 4096}
    assert hf_config_mapping(windowed, "x")["sliding_window_layers"] == "3-:4"
    given = {**windowed, "no_rope_layers": [0, 1] * 18}
    assert hf_config_mapping(given, "x")["sliding_window_layers"] == "0-:2"
    interval = {**windowed, "no_rope_layers": None, "no_rope_layer_interval": 6}
    assert hf_config_mapping(interval, "x")["sliding_window_layers"] == "5-:6"


def test_granite_is_llama_with_scalar_multipliers():
    config = json.loads((FIXTURES / "granite-config-defaults" / "config.json").read_text())
    granite = hf_config_mapping(config, "x")
    llama = hf_config_mapping({**config, "model_type": "llama"}, "x")
    assert granite.pop("source") != llama.pop("source") and granite == llama


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama4"}, "unsupported model_type 'llama4'; supported: llama, "),
        ({"model_type": "llama", "attention_bias": True}, "cannot model attention_bias"),
        ({"model_type": "llama", "mlp_bias": True}, "cannot model mlp_bias"),
        ({"model_type": "llama", "hidden_act": "relu2"}, "cannot model hidden_act"),
        (
            {"model_type": "gemma2", "layer_types": ["linear_attention"] * 32},
            "cannot model layer_types",
        ),
        ({"model_type": "gpt_neox", "attention_bias": False}, "cannot model attention_bias"),
    ],
)
def test_keys_ckplan_cannot_model_are_errors(changes, message):
    config = json.loads((FIXTURES / "Meta-Llama-3-8B" / "config.json").read_text())
    with pytest.raises(SpecError, match=message):
        hf_config_mapping({**config, **changes}, "x/config.json")


def test_gpt2_cross_attention_is_refused():
    config = json.loads((FIXTURES / "gpt2" / "config.json").read_text())
    with pytest.raises(SpecError, match="cannot model add_cross_attention"):
        hf_config_mapping({**config, "add_cross_attention": True}, "x/config.json")


def test_a_config_without_model_type():
    with pytest.raises(SpecError, match="no model_type"):
        hf_config_mapping({"num_hidden_layers": 2}, "x/config.json")


def test_qwen_moe_layer_rules():
    """decoder_sparse_step 2: layers 1, 3, ... sparse; mlp_only_layers stay dense."""
    config = json.loads((FIXTURES / "Qwen3-30B-A3B" / "config.json").read_text())
    mapping = hf_config_mapping(
        {**config, "decoder_sparse_step": 2, "mlp_only_layers": [1]}, "x/config.json"
    )
    assert mapping["moe_layers"] == "3-:2"


def test_a_config_json_runs_at_the_default_sequence_length_and_says_so():
    """Never silently the model's maximum context (Qwen2-7B allows 131,072 tokens)."""
    from ckplan.inputs.hf_config import DEFAULT_SEQ

    path = "tests/fixtures/hf/Qwen2-7B/config.json"
    spec = load_spec(path)
    assert spec.seq == DEFAULT_SEQ == 4096
    assert "seq 4,096: ckplan's default for a config.json" in spec.source
    assert "up to 131,072 tokens" in spec.source
    chosen = load_spec(path, {"seq": 8192})
    assert chosen.seq == 8192 and "default for a config.json" not in chosen.source


@pytest.mark.parametrize(
    "name", ["Mistral-7B-v0.1", "Mixtral-8x7B-v0.1", "Qwen3-30B-A3B", "DeepSeek-V3", "gemma-2-9b"]
)
@pytest.mark.parametrize("layers", [2.5, -2.5, float("nan")])
def test_a_layer_count_that_is_no_integer_is_refused_by_its_key(name, layers):
    """The families with per-layer rules (windows, MoE layers) loop over the layer count: one
    that is not an integer is refused by the spec, as in the other families."""
    config = json.loads((FIXTURES / name / "config.json").read_text())
    with pytest.raises(SpecError, match="key 'layers' expects an integer"):
        load_spec_of({**config, "num_hidden_layers": layers}, name)


def test_a_whole_float_layer_count_keeps_the_per_layer_rules():
    """JSON's 32.0 counts as 32 layers, the sliding window on every one of them."""
    config = json.loads((FIXTURES / "Mistral-7B-v0.1" / "config.json").read_text())
    spec = load_spec_of({**config, "num_hidden_layers": 32.0}, "Mistral-7B-v0.1")
    assert (spec.layers, spec.sliding_window, spec.sliding_window_layers) == (32, 4096, "all")


def load_spec_of(config, name):
    return spec_from_mapping(hf_config_mapping(config, f"{name}/config.json"))


def test_gpt_oss_20b():
    """gpt-oss-20b: 32 experts, top-4, in every layer, biased (Q, K, V, O, the experts and
    the router), a sink per head, a 128-token window on the even layers; 3.61B active (the
    model card's figure, which counts the output layer and not the input embedding)."""
    spec = load("gpt-oss-20b")
    assert (spec.experts, spec.top_k, spec.moe_ffn_hidden, spec.moe_layers) == (32, 4, 2880, "all")
    assert spec.bias and spec.qkv_bias and spec.attention_sinks and not spec.expert_bias
    assert (spec.heads, spec.kv_heads, spec.head_dim) == (64, 8, 64)
    assert (spec.sliding_window, spec.sliding_window_layers) == (128, "0-:2")
    counts = parameter_count(spec)
    assert round((counts.active - spec.vocab * spec.hidden) / 1e7) == 361
    assert "quantization_config (mxfp4) is not read" in spec.source
    assert "attention sinks" in spec.source


def test_gpt_oss_layer_counts_by_hand():
    """One gpt-oss-20b layer, term by term: Q, K, V, O with biases, 64 sinks, two RMSNorm
    gains, the router's weight and bias, 32 experts each with a 2F x h gate-up and F x h down
    projection and their biases."""
    h, a, g, d, E, F = 2880, 64, 8, 64, 32, 2880
    attention = h * a * d + a * d + 2 * (h * g * d + g * d) + a * d * h + h + a
    experts = E * (h * 2 * F + 2 * F + F * h + h)
    router = E * h + E
    spec = load("gpt-oss-20b")
    assert parameter_count(spec).per_layer == attention + 2 * h + router + experts


def test_olmo2_norms_all_heads_together():
    """OLMo 2: q_norm over a·d and k_norm over g·d (Olmo2Attention), not a head's d; the
    two norms after attention and the MLP counted as pre-norms (the same gains)."""
    spec = load("OLMo-2-1124-13B")
    assert spec.qk_norm and spec.qk_norm_width == "full" and not spec.bias
    assert not spec.post_norms and spec.dtype_bytes == 2
    per_head = parameter_count(spec.replace(qk_norm_width="head")).per_layer
    assert parameter_count(spec).per_layer - per_head == (40 * 128 - 128) + (40 * 128 - 128)
    assert "norms follow attention and the MLP" in spec.source


def test_olmo3_windows_three_layers_in_four():
    spec = load("olmo3-config-defaults")
    assert spec.qk_norm_width == "full" and spec.sliding_window == 4096
    kinds = layer_kinds(spec.replace(seq=8192))
    assert [kind.window for kind in kinds[:8]] == [4096, 4096, 4096, 0] * 2


def test_olmoe_experts_in_every_layer():
    spec = load("olmoe-config-defaults")
    assert (spec.experts, spec.top_k, spec.moe_layers) == (64, 8, "all")
    assert spec.qk_norm_width == "full" and not spec.bias and not spec.expert_bias


def test_a_quantized_checkpoint_is_counted_at_its_dtype():
    config = json.loads((FIXTURES / "Meta-Llama-3-8B" / "config.json").read_text())
    quantized = {**config, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    mapping = hf_config_mapping(quantized, "x/config.json")
    assert "quantization_config (gptq) is not read" in mapping["source"]
    assert mapping["dtype_bytes"] == 2


def test_mistral_small_3_language_model_by_hand():
    """Mistral Small 3.x (mistral3, text model mistral; the shapes of Mistral3Config's own
    text defaults, transformers v5.25.0): 40 layers of h 5,120, 32 query heads and 8 key/value
    heads of 128, SwiGLU 32,768 wide, vocabulary 131,072. Untied: 23,572,403,200; a file whose
    top level leaves tie_word_embeddings out is tied by Mistral3Config's default, one
    embedding fewer, and the source says so."""
    h, d, layers, ffn, vocab = 5120, 128, 40, 32768, 131072
    per_layer = h * 32 * d * 2 + h * 8 * d * 2 + 3 * h * ffn + 2 * h
    untied = layers * per_layer + 2 * vocab * h + h
    assert untied == 23_572_403_200
    config = json.loads((FIXTURES / "mistral3-config-defaults" / "config.json").read_text())
    tied = load("mistral3-config-defaults")
    assert parameter_count(tied).total == untied - vocab * h
    assert tied.tied_embeddings and "by the mistral3 config's default" in tied.source
    assert "(HF model_type mistral3, text model mistral)" in tied.source
    apart = load_spec_of({**config, "tie_word_embeddings": False}, "mistral3-config-defaults")
    assert parameter_count(apart).total == untied and not apart.tied_embeddings
    assert "config's default" not in apart.source
    assert (tied.head_dim, tied.kv_heads, tied.sliding_window) == (128, 8, 0)


def test_ministral_windows_follow_layer_types():
    """MinistralAttention (v5.25.0) slides on the layers layer_types names sliding_attention;
    without layer_types on every layer while sliding_window is set (4,096 by default)."""
    assert load("ministral-config-defaults").sliding_window_layers == "0-:2"
    config = json.loads((FIXTURES / "ministral-config-defaults" / "config.json").read_text())
    every = hf_config_mapping({**config, "layer_types": None}, "x")
    assert (every["sliding_window"], every["sliding_window_layers"]) == (4096, "all")
    default = {key: value for key, value in config.items() if key != "sliding_window"}
    assert hf_config_mapping({**default, "layer_types": None}, "x")["sliding_window"] == 4096
    assert "sliding_window" not in hf_config_mapping({**config, "sliding_window": None}, "x")
    assert not hf_config_mapping({**config, "attention_bias": True}, "x")["bias"]


def test_ministral3_window_on_every_layer():
    """Ministral3 (v5.25.0) gives every layer config.sliding_window, none by default, and does
    not read layer_types; head_dim 128 by default."""
    spec = load("ministral3-config-defaults")
    assert spec.sliding_window == 0 and spec.head_dim == 128
    config = json.loads((FIXTURES / "ministral3-config-defaults" / "config.json").read_text())
    halves = ["sliding_attention", "full_attention"] * 17
    windowed = hf_config_mapping({**config, "sliding_window": 8192, "layer_types": halves}, "x")
    assert (windowed["sliding_window"], windowed["sliding_window_layers"]) == (8192, "all")
    narrow = hf_config_mapping({**config, "head_dim": None, "hidden_size": 2048}, "x")
    assert narrow["head_dim"] == 128


def test_qwen3_vl_language_models():
    """Qwen3-VL's text model is Qwen3's layer (QK norms, head_dim 128 by default); Qwen3-VL-MoE's
    Qwen3-MoE's (60 experts, top 4, 1,408 wide by default, mlp_only_layers dense)."""
    dense = load("qwen3-vl-config-defaults")
    assert dense.qk_norm and not dense.experts and not dense.tied_embeddings
    assert "(HF model_type qwen3_vl, text model qwen3_vl_text)" in dense.source
    moe = load("qwen3-vl-moe-config-defaults")
    assert (moe.experts, moe.top_k, moe.moe_ffn_hidden, moe.moe_layers) == (60, 4, 1408, "all")
    assert moe.qk_norm and not moe.shared_experts
    config = json.loads((FIXTURES / "qwen3-vl-moe-config-defaults" / "config.json").read_text())
    text = {**config["text_config"], "mlp_only_layers": [0], "decoder_sparse_step": 1}
    assert hf_config_mapping({**config, "text_config": text}, "x")["moe_layers"] == "1-"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"text_config": None}, "key 'text_config' is missing: a mistral3 config holds"),
        ({"text_config": [1, 2]}, "key 'text_config' expects the language model's config"),
        (
            {"text_config": {"model_type": "llama"}},
            "key 'text_config.model_type' of a mistral3 config expects mistral or ministral3, "
            "got 'llama'",
        ),
        ({"tie_word_embeddings": "no"}, "key 'tie_word_embeddings' expects true or false"),
    ],
)
def test_a_multimodal_config_needs_its_text_model(changes, message):
    config = json.loads((FIXTURES / "mistral3-config-defaults" / "config.json").read_text())
    with pytest.raises(SpecError, match=message):
        hf_config_mapping({**config, **changes}, "x/config.json")


def test_seed_oss_biases_and_dropout():
    """Seed-OSS (v5.25.0 defaults): Q, K, V biased, O and the MLP not: qkv_bias; dropout 0.1 on
    the attention probabilities and after O and the MLP: ckplan's one rate."""
    spec = load("seed-oss-config-defaults")
    assert spec.qkv_bias and not spec.bias and spec.dropout == 0.1 and spec.head_dim == 128
    config = json.loads((FIXTURES / "seed-oss-config-defaults" / "config.json").read_text())
    every = {**config, "attention_out_bias": True, "mlp_bias": True}
    assert hf_config_mapping(every, "x")["bias"]
    none = {**config, "attention_bias": False, "attention_dropout": 0, "residual_dropout": 0}
    assert not hf_config_mapping(none, "x")["bias"] and hf_config_mapping(none, "x")["dropout"] == 0
    with pytest.raises(SpecError, match="cannot model attention_bias, attention_out_bias"):
        hf_config_mapping({**config, "attention_out_bias": True}, "x")
    with pytest.raises(SpecError, match=r"attention_dropout 0\.1, residual_dropout 0"):
        hf_config_mapping({**config, "residual_dropout": 0}, "x")
    with pytest.raises(SpecError, match="key 'residual_dropout' expects a rate in"):
        hf_config_mapping({**config, "residual_dropout": "0.1"}, "x")


def test_ernie_helium_starcoder2_layers():
    """ERNIE 4.5: use_bias on every projection, tied by default. Helium: Q, K, V biases alone,
    an h x h o_proj. StarCoder2: LayerNorm, a GeLU MLP of two matrices, biases everywhere,
    tied, a window on every layer when set, one dropout rate for its three."""
    ernie = load("ernie4_5-config-defaults")
    assert ernie.tied_embeddings and not ernie.bias and ernie.head_dim == 128
    config = json.loads((FIXTURES / "ernie4_5-config-defaults" / "config.json").read_text())
    assert hf_config_mapping({**config, "use_bias": True}, "x")["bias"]
    helium = json.loads((FIXTURES / "helium-config-defaults" / "config.json").read_text())
    assert hf_config_mapping({**helium, "attention_bias": True}, "x")["qkv_bias"]
    with pytest.raises(SpecError, match="cannot model mlp_bias"):
        hf_config_mapping({**helium, "mlp_bias": True}, "x")
    with pytest.raises(SpecError, match="cannot model head_dim"):
        hf_config_mapping({**helium, "head_dim": 64}, "x")
    coder = load("starcoder2-config-defaults")
    assert (coder.norm, coder.mlp, coder.bias, coder.tied_embeddings) == (
        "layernorm", "gelu", True, True,
    )  # fmt: skip
    config = json.loads((FIXTURES / "starcoder2-config-defaults" / "config.json").read_text())
    rates = {"attention_dropout": 0.1, "residual_dropout": 0.1, "embedding_dropout": 0.1}
    windowed = hf_config_mapping({**config, **rates, "sliding_window": 4096}, "x")
    assert (windowed["dropout"], windowed["sliding_window_layers"]) == (0.1, "all")
    with pytest.raises(SpecError, match=r"embedding_dropout 0\.0"):
        hf_config_mapping({**config, **rates, "embedding_dropout": 0.0}, "x")
    with pytest.raises(SpecError, match="cannot model hidden_act"):
        hf_config_mapping({**config, "hidden_act": "silu"}, "x")


def test_exaone4_is_olmo2s_layer_with_head_qk_norms_and_windows():
    """EXAONE 4.0: norms after the sublayers (counted as pre-norms), per-head QK norms, a window
    on three layers of four by default; a pattern string needs layer_types, which the
    checkpoints give."""
    spec = load("exaone4-config-defaults")
    assert spec.qk_norm and spec.qk_norm_width == "head" and not spec.bias
    assert spec.sliding_window == 4096 and spec.sliding_window_layers.startswith("0-2,4-6")
    assert "counted as pre-norms" in spec.source
    config = json.loads((FIXTURES / "exaone4-config-defaults" / "config.json").read_text())
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    given = {**config, "sliding_window_pattern": "LLLG", "layer_types": kinds * 8}
    assert (
        hf_config_mapping(given, "x")["sliding_window_layers"]
        == "0-2,4-6,8-10,12-14,16-18,20-22,24-26,28-30"
    )
    with pytest.raises(SpecError, match="cannot model sliding_window_pattern"):
        hf_config_mapping({**config, "sliding_window_pattern": "LLLG"}, "x")
    assert "sliding_window" not in hf_config_mapping({**config, "sliding_window": None}, "x")


def test_minimax_m2_230b_10b_active():
    """MiniMax-M2: 256 experts of 1,536 in all 62 layers, top 8, sigmoid routing with a
    correction bias, QK norms over all heads; about 230B parameters, 10B active without the
    input embedding (the model card: "230 billion total parameters with 10 billion active")."""
    spec = load("minimax-m2-config-defaults")
    assert (spec.experts, spec.top_k, spec.expert_bias, spec.qk_norm_width) == (
        256,
        8,
        True,
        "full",
    )
    counts = parameter_count(spec)
    assert round(counts.total / 1e9) == 229
    assert round((counts.active - spec.vocab * spec.hidden) / 1e9) == 10
    config = json.loads((FIXTURES / "minimax-m2-config-defaults" / "config.json").read_text())
    noted = hf_config_mapping({**config, "use_mtp": True, "num_mtp_modules": 3}, "x")
    assert "its 3 multi-token-prediction module(s) (use_mtp) not counted" in noted["source"]


def test_ernie4_5_moe_layers_experts_and_shared_mlp():
    """ERNIE-4.5-21B-A3B's shapes (Ernie4_5_MoeConfig's defaults): 64 experts of 1,536, top 6,
    two shared experts as one MLP of 3,072, a correction bias per expert, layers 1 to 27 sparse;
    21.8B parameters, 3.4B active with the tied embedding once. The layer rule follows
    Ernie4_5_MoeDecoderLayer: (i + 1) % interval == 0 within [start, end]."""
    spec = load("ernie4_5-moe-config-defaults")
    assert (spec.experts, spec.top_k, spec.moe_ffn_hidden, spec.moe_layers) == (64, 6, 1536, "1-")
    assert (spec.shared_experts, spec.expert_bias, spec.tied_embeddings) == (2, True, True)
    assert "set mtp_layers=1" in spec.source
    counts = parameter_count(spec)
    assert (round(counts.total / 1e8), round(counts.active / 1e8)) == (218, 34)
    config = json.loads((FIXTURES / "ernie4_5-moe-config-defaults" / "config.json").read_text())
    rule = {"moe_layer_interval": 2, "moe_layer_start_index": 3, "moe_layer_end_index": 20}
    assert hf_config_mapping({**config, **rule}, "x")["moe_layers"] == "3,5,7,9,11,13,15,17,19"
    alias = {key: value for key, value in config.items() if key != "num_nextn_predict_layers"}
    assert "set mtp_layers=1" in hf_config_mapping({**alias, "num_mtp_layers": 1}, "x")["source"]
    with pytest.raises(SpecError, match="cannot model use_bias"):
        hf_config_mapping({**config, "use_bias": True}, "x")


def test_granite_moe_experts_and_shared_mlp():
    """Granite 3.x MoE: experts in every layer, top 2, a router without bias; GraniteMoeShared
    adds one ungated shared MLP of shared_intermediate_size (none at 0, its default); Q, K, V
    and O biases without expert biases are refused."""
    moe = load("granitemoe-config-defaults")
    assert (moe.experts, moe.top_k, moe.shared_experts, moe.bias) == (8, 2, 0, False)
    shared = load("granitemoeshared-shared-mlp")
    assert (shared.shared_experts, shared.shared_ffn_hidden) == (1, 1024)
    assert not shared.shared_expert_gate
    config = json.loads((FIXTURES / "granitemoeshared-shared-mlp" / "config.json").read_text())
    assert "shared_experts" not in hf_config_mapping({**config, "shared_intermediate_size": 0}, "x")
    with pytest.raises(SpecError, match="cannot model attention_bias"):
        hf_config_mapping({**config, "attention_bias": True}, "x")


def test_hunyuan_dense_has_qwen3s_qk_norms():
    """Hunyuan dense: per-head QK norms (after RoPE), Llama's biases rule."""
    spec = load("hunyuan-dense-config-defaults")
    assert spec.qk_norm and spec.qk_norm_width == "head" and not spec.bias
    config = json.loads((FIXTURES / "hunyuan-dense-config-defaults" / "config.json").read_text())
    with pytest.raises(SpecError, match="cannot model attention_bias"):
        hf_config_mapping({**config, "attention_bias": True}, "x")


def test_a_multimodal_files_dtype_and_quantization_reach_its_language_model():
    """The outer file's torch_dtype and quantization_config speak for the language model."""
    config = json.loads((FIXTURES / "mistral3-config-defaults" / "config.json").read_text())
    stored = {**config, "torch_dtype": "float32", "quantization_config": {"quant_method": "fp8"}}
    source = hf_config_mapping(stored, "x")["source"]
    assert "stored in float32" in source and "quantization_config (fp8) is not read" in source
