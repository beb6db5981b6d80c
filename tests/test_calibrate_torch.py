"""`ckplan calibrate` against PyTorch autograd (CPU): the fitted profiles, their check at a shape
left out of the fit, the attribution rule against the explicit op tags of the validation
layers, and the profile through `ckplan estimate`. Needs torch (tests/needs_torch.py)."""

import json
from pathlib import Path

import pytest
import yaml
from needs_frameworks import framework_or_skip
from needs_torch import torch_or_skip

from ckplan.cli import main
from ckplan.inputs.presets import load_spec
from ckplan.inputs.profiles import load_profile
from ckplan.model.ops import transformer_layer_ops
from ckplan.model.profiles import apply_profile, profile_from_mapping

torch = torch_or_skip()

from ckplan.calibrate.attribute import attribute  # noqa: E402
from ckplan.calibrate.layers import Config, GPTLayer, LlamaLayer  # noqa: E402
from ckplan.calibrate.record import CallRecorder  # noqa: E402
from ckplan.calibrate.run import calibrate, compare_with_fused  # noqa: E402


@pytest.fixture(scope="module")
def llama_eager():
    return calibrate(load_spec("llama3-8b", {"attention": "standard"}))


@pytest.fixture(scope="module")
def llama_sdpa():
    return calibrate(load_spec("llama3-8b"))


@pytest.fixture(scope="module")
def gpt_dropout():
    return calibrate(load_spec("gpt2", {"dropout": 0.1}))


def _bytes(spec, profile):
    return [op.saved_bytes for op in apply_profile(transformer_layer_ops(spec), spec, profile)]


@pytest.mark.parametrize(
    "layout",
    [{}, {"seq": 2048, "micro_batch": 3}, {"tp": 4, "sp": True}, {"tp": 8, "cp": 2}],
)
def test_calibrated_hf_eager_llama_is_torch_eager(llama_eager, layout):
    """The Hugging Face eager Llama layer, measured and fitted, is the shipped torch-eager
    profile, op for op, at any size and layout."""
    spec = load_spec("llama3-8b", {"attention": "standard", **layout})
    measured = profile_from_mapping(llama_eager.profile, "calibrated")
    assert _bytes(spec, measured) == _bytes(spec, load_profile("torch-eager"))


def test_calibrated_sdpa_llama_is_torch_sdpa(llama_sdpa):
    spec = load_spec("llama3-70b", {"tp": 8, "sp": True, "seq": 4096})
    measured = profile_from_mapping(llama_sdpa.profile, "calibrated")
    assert _bytes(spec, measured) == _bytes(spec, load_profile("torch-sdpa"))
    assert llama_sdpa.check.sdpa_node == "ScaledDotProductFlashAttentionForCpuBackward0"


def test_calibrated_gpt_is_korthikanti_plus_cpu_layernorm_statistics(gpt_dropout):
    """The GPT block with 1-byte dropout masks is fused's table (Korthikanti's 34sbh + 5as²b)
    except LayerNorm's mean and rstd, which the CPU keeps in the activation dtype: 2·B·sb per
    norm (docs/validation.md §1)."""
    rows = {row["op"]: row for row in compare_with_fused(gpt_dropout)}
    for op, row in rows.items():
        if op in ("norm1", "norm2"):
            assert row["calibrated"] == "B·sbh + 2B·sb"
            s, b = 1024, 1
            assert row["calibrated_bytes"] - row["fused_bytes"] == 2 * 2 * s * b
        else:
            assert row["calibrated"] == row["fused"], op
            assert row["calibrated_bytes"] == row["fused_bytes"], op


@pytest.mark.parametrize("fixture", ["llama_eager", "llama_sdpa", "gpt_dropout"])
def test_exact_fit_and_held_out_check(request, fixture):
    result = request.getfixturevalue(fixture)
    assert result.max_residual == 0
    assert result.check_error == 0  # within 1 % is the bar; the fit is exact
    assert result.check.bytes_by_op == {k: v for k, v in result.check_predicted.items() if v}
    assert not result.unmeasured and not result.unmodelled


VALIDATION_CONFIGS = [
    Config("gpt-native", "gpt", "bfloat16", dropout=0.1, dropout_impl="native"),
    Config("gpt-functional", "gpt", "float32", dropout=0.1),
    Config("gpt-maskedfill", "gpt", "bfloat16", mask="masked_fill"),
    Config("gpt-sdpa", "gpt", "bfloat16", attention="sdpa"),
    Config("llama-hf", "llama", "bfloat16", kv_heads=2, ffn_hidden=704, norm_impl="hf"),
    Config("llama-repeat", "llama", "bfloat16", kv_heads=2, ffn_hidden=704, attention="sdpa",
           kv_repeat=True),
    Config("llama-fused", "llama", "bfloat16", kv_heads=2, ffn_hidden=704, norm_impl="fused",
           attention="sdpa", swiglu_impl="fused"),
]  # fmt: skip


@pytest.mark.parametrize("config", VALIDATION_CONFIGS, ids=lambda c: c.name)
def test_rule_agrees_with_the_validation_layers_tags(config):
    """validation/torch_saved_bytes.py tags each op of its layers by hand; the rule that
    calibrate applies to any layer gives every save the same op (smaller shapes than there)."""
    config.seq, config.micro_batch, config.hidden, config.heads = 32, 2, 64, 4
    config.kv_heads = min(config.kv_heads, 4)
    config.ffn_hidden = 96 if config.arch == "llama" else 256
    torch.manual_seed(0)
    layer = (GPTLayer if config.arch == "gpt" else LlamaLayer)(config)
    layer = layer.to(dtype=config.torch_dtype).train()
    x = torch.randn(2, 32, 64, dtype=config.torch_dtype, requires_grad=True)
    recorder = CallRecorder(layer, set(), native_dropout=False)
    with recorder.recording():
        layer(x, recorder)
    labels = attribute(recorder.calls)
    saves = [(tag, labels[call]) for s in recorder.storages.values()
             for tag, call in zip(s.tags, s.calls, strict=True)]  # fmt: skip
    assert len(saves) > 10
    assert all(tag == label for tag, label in saves), [s for s in saves if s[0] != s[1]]


def test_calibrate_then_estimate_at_the_held_out_shape(tmp_path, capsys):
    """The must-show: with the calibrated profile, `ckplan estimate` predicts what autograd
    saves for one layer at a shape not used in fitting (here exactly)."""
    out = tmp_path / "gpt.yaml"
    assert main(["calibrate", "gpt2", "--set", "dropout=0.1", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    check = report["check"]
    s, b, h, a, g, F = (int(part.split("=")[1]) for part in check["shape"].split())
    model = tmp_path / "check.yaml"
    model.write_text(
        f"name: check\nlayers: 1\nhidden: {h}\nheads: {a}\nkv_heads: {g}\nffn_hidden: {F}\n"
        f"seq: {s}\nmicro_batch: {b}\ndropout: 0.1\nprofile: gpt.yaml\n"
    )
    assert main(["estimate", str(model), "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    predicted = estimate["memory"]["per_layer_activation_bytes"]
    assert predicted == check["measured_bytes"] == check["predicted_bytes"]
    assert report["written"] == str(out) and out.read_text().startswith("# A kernel profile")
    assert report["profile"]["requires"] == [
        "attention=standard", "norm=layernorm", "mlp=gelu", "dropout", "!gqa", "!qk_norm",
        "dtype_bytes=2",
    ]  # fmt: skip


def test_calibrated_profile_refuses_another_architecture(tmp_path, capsys, llama_eager):
    import yaml

    path = tmp_path / "l.yaml"
    path.write_text(yaml.safe_dump(llama_eager.profile))
    code = main(["estimate", "llama3-8b", "--profile", str(path)])
    _, err = capsys.readouterr()
    assert code == 2 and "attention=standard" in err and len(err.strip().splitlines()) == 1


def test_calibrate_unsupported_block_is_one_line(capsys):
    code = main(["calibrate", "gpt2", "--set", "mlp=swiglu"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "--hf" in err and len(err.strip().splitlines()) == 1


def test_hf_llama_layer_is_torch_eager():
    """The real transformers LlamaDecoderLayer (random weights), when transformers is here."""
    framework_or_skip("transformers", "--hf not tested")
    result = calibrate(load_spec("llama3-8b", {"attention": "standard"}), hf=True)
    spec = load_spec("llama3-8b", {"attention": "standard"})
    measured = profile_from_mapping(result.profile, "hf")
    assert result.max_residual == 0 and result.check_error == 0
    assert _bytes(spec, measured) == _bytes(spec, load_profile("torch-eager"))


@pytest.fixture(scope="module")
def eager_backward():
    """validation/calibrated_profiles.py --backward at two of its shapes."""
    import importlib.util
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "validation" / "calibrated_profiles.py"
    spec = importlib.util.spec_from_file_location("calibrated_profiles", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.BACKWARD_SHAPES = [(128, 2, 256, 8, 2, 704), (512, 2, 256, 8, 2, 704)]
    return module.backward("bfloat16") + module.backward("float32")


def test_torch_eager_backward_fields_predict_the_hf_eager_peak(eager_backward):
    """torch-eager's backward fields (LlamaRMSNorm's fp32 composite, the fp32 softmax's
    gradient casts, eager's scale multiply, repeat_kv's sums to g heads): the walk gives the
    measured peak of the HF eager Llama block's backward within a few scalars, at as/h = 4
    (peak in the MLP) and 16 (peak at the softmax), bf16 and fp32."""
    for row in eager_backward:
        assert 0 <= row["measured_peak_bytes"] - row["predicted_peak_bytes"] <= 64, row["shape"]
        ops = row["ops"]
        exact = ["norm2", "softmax", "attn_scores", "act"]
        if row["dtype"] == "float32":  # no oneDNN bf16 GEMM scratchpads in the linears' steps
            exact += ["fc2", "fc1", "out_proj", "attn_values"]
        for op in exact:
            assert 0 <= ops[op]["measured"] - ops[op]["predicted"] <= 64, (row["shape"], op)


def test_hf_layer_from_a_config_json(tmp_path, capsys):
    """--hf with a config.json builds that model type's decoder layer (here Qwen2, with QKV
    biases): the same eager saves as Llama's."""
    framework_or_skip("transformers", "--hf not tested")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
        "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": True,
    }))  # fmt: skip
    argv = ["calibrate", str(config), "--hf", "--set", "attention=standard", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert "qwen2 decoder layer" in report["block"] and report["check"]["error"] == 0
    assert report["profile"]["ops"]["softmax"] == {"saved": {"as2b": 4}}


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"


@pytest.mark.parametrize("training", ["full", "lora"])
def test_hf_qwen3_qk_norms_are_torch_sdpa(training):
    """Qwen3's norms on each head of Q and K, measured on transformers' own layer: exactly the
    torch-sdpa profile's qk_norm, (4 + B)·(sbad + sbgd) + 4·(asb + gsb), and 4·(...) + 4·(...)
    beside a frozen gain; the whole layer is torch-sdpa at a model's size."""
    framework_or_skip("transformers", "--hf not tested")
    keys = {} if training == "full" else {"training": "lora", "lora_targets": "q_proj,v_proj"}
    if training == "lora":
        framework_or_skip("peft", "--hf with LoRA not tested")
    spec = load_spec(str(FIXTURES / "Qwen3-8B" / "config.json"), {"framework": "hf", **keys})
    result = calibrate(
        spec, hf=True, hf_config=json.loads((FIXTURES / "Qwen3-8B" / "config.json").read_text())
    )
    assert result.max_residual == 0 and result.check_error == 0
    assert result.profile["ops"]["qk_norm"]["saved"] == {
        "sbad": "B+4", "sbgd": "B+4", "asb": 4, "gsb": 4,
    }  # fmt: skip
    assert "qk_norm" in result.profile["requires"]
    measured = profile_from_mapping(result.profile, "hf")
    layouts = [{}] if training == "lora" else [{}, {"framework": "megatron", "tp": 4, "sp": True}]
    for layout in layouts:
        at = spec.replace(**layout)
        assert _bytes(at, measured) == _bytes(at, load_profile("torch-sdpa"))


def test_hf_olmo2_post_norms_save_what_pre_norms_would():
    """OLMo 2's norms on the sublayers' outputs, counted as ckplan's norm2 and norm1: each an
    exact function of the terms over s·b·h-wide rows, as a pre-norm; its RMSNorm multiplies
    the gain in fp32 (`(self.weight * hidden_states).to(input_dtype)`, modeling_olmo2.py
    transformers v5.25.0), 8 bytes an element where Llama's saves 4 + B. Its full-width QK
    norms likewise: 8·(sbad + sbgd) and one fp32 statistic per token for each."""
    framework_or_skip("transformers", "--hf not tested")
    path = FIXTURES / "OLMo-2-1124-13B" / "config.json"
    result = calibrate(load_spec(str(path), {}), hf=True, hf_config=json.loads(path.read_text()))
    assert result.max_residual == 0 and result.check_error == 0
    ops = result.profile["ops"]
    assert ops["norm1"]["saved"] == ops["norm2"]["saved"] == {"sbh": 8, "sb": 4}
    assert ops["qk_norm"]["saved"] == {"sbad": 16, "sb": 8}  # MHA: sbgd is sbad
    spec = result.spec
    table = transformer_layer_ops(spec)
    fitted = apply_profile(table, spec, profile_from_mapping(result.profile, "hf"))
    shipped = apply_profile(table, spec, load_profile("torch-sdpa"))
    for mine, theirs in zip(fitted, shipped, strict=True):
        if mine.name in ("qkv_proj", "attention_core", "out_proj", "fc1", "act", "fc2"):
            assert mine.saved_bytes == theirs.saved_bytes, mine.name


def test_hf_gemma2_four_norms_and_its_geglu():
    """Gemma 2's four norms are read as norm1, post_attn_norm, norm2 and post_mlp_norm, and its
    eager gelu_pytorch_tanh(gate) * up saves gate, its GELU and up: 3B·sbF, the torch-sdpa and
    torch-eager profiles' act under mlp geglu. (Its RMSNorm also saves `1 + weight` in fp32,
    h values no term writes: the norms keep a residual, the other ops fit exactly.)"""
    framework_or_skip("transformers", "--hf not tested")
    path = FIXTURES / "gemma-2-9b" / "config.json"
    spec = load_spec(str(path), {"attention": "standard"})  # SDPA has no softcap
    result = calibrate(spec, hf=True, hf_config=json.loads(path.read_text()))
    for op in ("norm1", "post_attn_norm", "norm2", "post_mlp_norm"):
        assert result.fits[op].max_residual > 0, op
    exact = {op: fit for op, fit in result.fits.items() if "norm" not in op}
    assert exact and all(fit.max_residual == 0 for fit in exact.values())
    assert result.profile["ops"]["act"]["saved"] == {"sbF": "3B"}
    for name in ("torch-sdpa", "torch-eager"):
        shipped = load_profile(name)
        at = spec.replace(attention="flash") if name == "torch-sdpa" else spec
        act = next(
            op for op in apply_profile(transformer_layer_ops(at), at, shipped) if op.name == "act"
        )
        tokens = at.seq * at.micro_batch
        assert act.saved_bytes == 3 * at.dtype_bytes * tokens * at.ffn_hidden, name


def test_cuda_without_a_gpu_is_one_line(capsys):
    """--device cuda is guarded: on a machine without CUDA, one line and exit 2. (The CUDA path
    itself, ckplan/calibrate/cuda.py, has not been run: no GPU here.)"""
    import ckplan.calibrate.cuda as cuda

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this checks the guard on machines without one")
    code = main(["calibrate", "gpt2", "--device", "cuda"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "no CUDA device" in err
    assert cuda.gpu_shape(load_spec("llama3-8b")).kv_heads == 2


EXAMPLE_MODULE = "examples/modules/my_block.py:build"


def test_calibrate_a_module_of_ones_own(tmp_path, capsys, monkeypatch):
    """`--module FILE.py:FACTORY`: the example block (torch's RMSNorm, separate projections,
    RoPE on buffers, SDPA, eager SwiGLU) fits exactly, checks on the held-out shape, and the
    profile it writes is what estimate then uses."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    out = tmp_path / "mine.yaml"
    code = main(
        ["calibrate", "llama3-8b", "--set", "dtype_bytes=4", "--module", EXAMPLE_MODULE,
         "-o", str(out), "--json"]
    )  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["check"]["measured_bytes"] == report["check"]["predicted_bytes"]
    assert "my_block.py:build" in report["block"]
    profile = load_profile(str(out))
    spec = load_spec("llama3-8b", {"dtype_bytes": 4, "seq": 48, "micro_batch": 2})
    names = [op.name for op in transformer_layer_ops(spec)]
    saved = dict(zip(names, _bytes(spec, profile), strict=True))
    # torch's nn.RMSNorm keeps its input and the normalised input (2B·sbh) and the fp32 rms
    assert saved["norm1"] == 2 * 4 * 48 * 2 * 4096 + 4 * 48 * 2


@pytest.mark.parametrize(
    ("module", "fragment"),
    [
        ("no_colon", "expected PACKAGE.MODULE:FACTORY or FILE.py:FACTORY"),
        ("missing.py:build", "no file 'missing.py'"),
        ("examples/modules/my_block.py:nothing", "has no callable 'nothing'"),
        ("no_such_package_xyz:build", "importing 'no_such_package_xyz' failed"),
        ("json:dumps", "the factory failed"),
    ],
)
def test_calibrate_bad_modules_are_one_line(capsys, monkeypatch, module, fragment):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    code = main(["calibrate", "llama3-8b", "--module", module])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err


PEFT_CASES = [
    ("standard", {"training": "lora", "lora_targets": "all-linear", "lora_dropout": 0.05}),
    ("flash", {"training": "lora", "lora_targets": "q_proj,v_proj,o_proj"}),
    ("flash", {"training": "frozen"}),
]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(("attention", "settings"), PEFT_CASES)
def test_hf_layer_with_peft_adapters(tmp_path, attention, settings):
    """--hf with training: lora or frozen checks transformers' layer wrapped by PEFT's own LoRA
    layers (or frozen) at the held-out shape: every op's saved bytes are what `ckplan estimate`
    computes (the profile, then ckplan's frozen linears and adapters), each adapter measured
    with its linear. The frozen norm gains save 4·sbh + 4·sb, the profile's training case."""
    framework_or_skip("transformers", "--hf not tested")
    framework_or_skip("peft", "--hf with LoRA not tested")
    from ckplan.model.memory import activation_bytes_by_op

    spec = load_spec("llama3-8b", {"attention": attention, **settings})
    result = calibrate(spec, hf=True)
    assert result.max_residual == 0 and result.check_error == 0
    frozen_norm = {"!training=full": {"saved": {"sb": 4, "sbh": 4}}}
    assert result.profile["ops"]["norm1"]["when"] == frozen_norm
    assert result.profile["ops"]["norm2"]["when"] == frozen_norm
    # what estimate computes at the check shape with the profile written by --out
    profile = tmp_path / "calibrated.yaml"
    profile.write_text(yaml.safe_dump(result.profile))
    shape = result.check.shape
    at_check = {
        "attention": attention, **settings, "profile": str(profile),
        "seq": shape.seq, "micro_batch": shape.batch, "hidden": shape.hidden,
        "heads": shape.heads, "kv_heads": shape.kv_heads, "ffn_hidden": shape.ffn, "layers": 1,
    }  # fmt: skip
    predicted = activation_bytes_by_op(load_spec("llama3-8b", at_check))
    for op in [op for op in predicted if op.endswith("_lora")]:
        predicted[op.removesuffix("_lora")] += predicted.pop(op)
    measured = dict(result.check.bytes_by_op)
    # flash attention's output O: saved by the kernel, counted with out_proj by ckplan and with
    # the attention core by the measurement when o_proj (frozen, no adapter reading O) does not
    for op in ("out_proj", "attention_core"):
        measured.setdefault(op, 0)
    if "attention_core" in predicted:
        moved = predicted["out_proj"] - measured["out_proj"]
        assert moved in (0, predicted["out_proj"])
        measured["attention_core"] -= moved
        measured["out_proj"] += moved
    assert {op: b for op, b in measured.items() if b} == {op: b for op, b in predicted.items() if b}
    lora = settings.get("training") == "lora"
    assert measured.get("qkv_proj", 0) > 0 if lora else measured.get("qkv_proj", 0) == 0


def test_calibrate_refuses_dora_and_qlora(capsys):
    """DoRA and QLoRA are refused in one line (DoRA is checked in tests/test_finetune_torch.py;
    QLoRA's 4-bit layers need bitsandbytes on CUDA)."""
    for training in (["training=lora", "use_dora=true"], ["training=qlora"]):
        argv = ["calibrate", "llama3-8b", "--hf"]
        for setting in training:
            argv += ["--set", setting]
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1
        assert ("DoRA" if "use_dora=true" in training else "bitsandbytes") in err


@pytest.mark.parametrize("head_dim", [16, 32])
def test_hf_qwen3_with_heads_wider_than_h_is_torch_sdpa(head_dim, monkeypatch):
    """Where a·d is not h (Gemma, Qwen3-MoE, gpt-oss, GLM-4.5), the tensors at the attention
    heads (Q, the context, out_proj's input, the QK norms') are a·d wide: transformers' Qwen3
    layer with h 64 and 4 heads of 16 (a·d = h) or 32 (a·d = 2h) saves, op by op, what the
    torch-sdpa profile counts with sbad = s·b·a·d."""
    framework_or_skip("transformers", "--hf not tested")
    import ckplan.calibrate.hf as hf_module
    from ckplan.calibrate.fit import Shape
    from ckplan.calibrate.run import measure
    from ckplan.model.spec import spec_from_mapping

    resize = hf_module._resize

    def with_head_dim(hf_config, spec, shape):
        resize(hf_config, spec, shape)
        hf_config.head_dim = head_dim

    monkeypatch.setattr(hf_module, "_resize", with_head_dim)
    shape = Shape(seq=16, batch=2, hidden=64, heads=4, kv_heads=2, ffn=96)
    keys = {
        "name": "qwen3-tiny", "layers": 1, "hidden": 64, "heads": 4, "kv_heads": 2,
        "head_dim": head_dim, "ffn_hidden": 96, "seq": 16, "micro_batch": 2, "vocab": 0,
        "dtype_bytes": 2, "norm": "rmsnorm", "mlp": "swiglu", "attention": "flash",
        "positions": "rope", "bias": False, "dropout": 0, "qk_norm": True, "framework": "hf",
    }  # fmt: skip
    spec = spec_from_mapping(keys)
    config = {"model_type": "qwen3", "attention_bias": False}
    measured = measure(spec, shape, torch.bfloat16, "cpu", hf=True, hf_config=config)
    table = apply_profile(transformer_layer_ops(spec), spec, load_profile("torch-sdpa"))
    predicted = {op.name: op.saved_bytes for op in table if op.saved_bytes}
    assert measured.bytes_by_op == predicted
    assert predicted["out_proj"] == 2 * 16 * 2 * 4 * head_dim  # B·s·b·a·d
