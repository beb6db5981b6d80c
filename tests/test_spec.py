import json

import pytest

from ckplan.inputs.hf_config import hf_config_mapping
from ckplan.inputs.presets import load_spec, preset_names
from ckplan.model.spec import SpecError, spec_from_mapping

BASE = {"name": "t", "layers": 2, "hidden": 64, "heads": 4, "seq": 16, "micro_batch": 2}


def test_defaults_resolved():
    spec = spec_from_mapping(BASE)
    assert spec.kv_heads == 4 and spec.ffn_hidden == 256 and spec.head_dim == 16
    assert spec.tp == spec.pp == spec.dp == 1 and spec.zero == 0 and not spec.sp


def test_spec_is_immutable():
    spec = spec_from_mapping(BASE)
    with pytest.raises(AttributeError):
        spec.layers = 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hiden": 64}, "unknown key 'hiden' (did you mean 'hidden'?)"),
        ({"layers": 0}, "key 'layers' must be a positive integer"),
        ({"seq": -5}, "key 'seq' must be a positive integer"),
        ({"heads": 5}, "key 'heads' (5) must divide hidden (64)"),
        ({"kv_heads": 3}, "key 'kv_heads' (3) must divide heads (4)"),
        ({"norm": "batchnorm"}, "key 'norm' must be one of layernorm, rmsnorm"),
        ({"layers": "many"}, "key 'layers' expects an integer"),
        ({"layers": 2.5}, "key 'layers' expects an integer"),
        ({"bias": "maybe"}, "key 'bias' expects true or false"),
        ({"dropout": 1.5}, "key 'dropout' must be in [0, 1)"),
        ({"zero": 4}, "key 'zero' must be 0, 1, 2 or 3"),
        ({"pp": 3}, "key 'pp' (3) must divide layers (2)"),
        ({"sp": True}, "key 'sp' (sequence parallelism) needs tp > 1"),
        ({"tp": 3}, "key 'tp' (3) must divide heads (4)"),
    ],
)
def test_invalid_values_name_the_key(change, message):
    with pytest.raises(SpecError) as info:
        spec_from_mapping({**BASE, **change}, "m.yaml")
    assert message in str(info.value)
    assert str(info.value).startswith("m.yaml: ")
    assert "\n" not in str(info.value)


def test_missing_required_key():
    with pytest.raises(SpecError, match="missing required key 'seq'"):
        spec_from_mapping({k: v for k, v in BASE.items() if k != "seq"})


def test_mlp_kind_needs_no_seq():
    spec = spec_from_mapping(
        {"name": "m", "kind": "mlp", "layers": 4, "hidden": 8, "micro_batch": 3}
    )
    assert spec.seq == 1 and spec.ffn_hidden == 32


def test_every_preset_loads_and_cites_a_source():
    names = preset_names()
    for expected in [
        "gpt2",
        "gpt2-xl",
        "gpt3-175b",
        "megatron-22b",
        "megatron-175b",
        "megatron-530b",
        "megatron-1t",
        "llama2-7b",
        "llama2-70b",
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "mistral-7b",
        "example-8192",
    ]:
        assert expected in names
    for name in names:
        spec = load_spec(name)
        assert spec.name == name
        assert spec.source, name


def test_unknown_preset_suggests(tmp_path):
    with pytest.raises(SpecError, match="did you mean 'llama3-8b'"):
        load_spec("llama3-8")


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("layers: [1, 2\n")
    with pytest.raises(SpecError, match="malformed YAML at line"):
        load_spec(str(bad))
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(SpecError, match="expected a YAML mapping"):
        load_spec(str(scalar))
    with pytest.raises(SpecError, match="no such file"):
        load_spec(str(tmp_path / "missing.yaml"))


def test_overrides_apply_before_validation():
    spec = load_spec("gpt2", {"seq": "512", "micro_batch": 4})
    assert spec.seq == 512 and spec.micro_batch == 4


def test_hf_config_llama(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    }
    path = tmp_path / "Meta-Llama-3-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    spec = load_spec(str(path))
    preset = load_spec("llama3-8b")
    for key in (
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "ffn_hidden",
        "vocab",
        "seq",
        "norm",
        "mlp",
        "attention",
        "positions",
        "bias",
        "tied_embeddings",
        "dtype_bytes",
    ):
        if key == "seq":  # a config.json runs at ckplan's default, never its maximum context
            assert spec.seq == min(4096, preset.seq)
            continue
        assert getattr(spec, key) == getattr(preset, key), key
    assert spec.name == "Meta-Llama-3-8B"


def test_hf_config_gpt2():
    mapping = hf_config_mapping(
        {
            "model_type": "gpt2",
            "n_layer": 12,
            "n_embd": 768,
            "n_head": 12,
            "n_positions": 1024,
            "vocab_size": 50257,
            "activation_function": "gelu_new",
            "attn_pdrop": 0.1,
        },
        "gpt2/config.json",
    )
    spec = spec_from_mapping(mapping)
    assert (spec.norm, spec.mlp, spec.positions, spec.tied_embeddings) == (
        "layernorm",
        "gelu",
        "learned",
        True,
    )


def test_hf_config_not_recognised():
    with pytest.raises(SpecError, match="not a recognised Hugging Face config"):
        hf_config_mapping({"foo": 1}, "x/config.json")


def test_presets_ship_as_package_data():
    """The installed package (wheel or editable) carries the presets as ckplan.preset_data."""
    from importlib import resources

    shipped = {entry.name for entry in resources.files("ckplan.preset_data").iterdir()}
    assert {f"{name}.yaml" for name in preset_names()} <= shipped
