"""`ckplan export --to peft`: the snippet parses, its keyword values are the plan's, the plans
Hugging Face's Trainer cannot run are refused, and (when peft and transformers are installed)
the objects construct."""

import ast
import re

import pytest
from needs_frameworks import framework_or_skip

from ckplan import exports
from ckplan.exports import ExportError
from ckplan.plan import evaluate, parse_strategy

LLAMA = dict(framework="hf", seq=1024, micro_batch=2, microbatches=4)


def plan_of(spec, name):
    return evaluate(spec, parse_strategy(name, spec))


def run_snippet(spec, tmp_path) -> dict:
    """The `full` plan's snippet run against the installed libraries on the CPU: its names."""
    text = exports.export(plan_of(spec, "full"), "peft").text
    text = text.replace('output_dir="out"', f"output_dir={str(tmp_path)!r}")
    text = text.replace("bf16=True,", "bf16=True, use_cpu=True,")  # no GPU here
    namespace: dict = {}
    exec(compile(text, "peft_snippet", "exec"), namespace)
    return namespace


def calls(text):
    """Each constructor call of the snippet: name -> {keyword: value} (dtypes as their text)."""
    out = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            out[node.func.id] = {
                kw.arg: ast.unparse(kw.value)
                if isinstance(kw.value, ast.Attribute)
                else ast.literal_eval(kw.value)
                for kw in node.keywords
            }
    return out


def test_qlora_snippet_matches_the_plan(spec_of):
    spec = spec_of(
        "llama3-8b",
        **LLAMA,
        training="qlora",
        lora_rank=32,
        lora_alpha=64,
        lora_targets="all-linear",
        lora_dropout=0.05,
        optimizer="paged-adamw-8bit",
    )
    text = exports.export(plan_of(spec, "full"), "peft").text
    got = calls(text)
    assert got["BitsAndBytesConfig"] == {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "torch.bfloat16",
    }
    assert got["LoraConfig"] == {
        "r": 32,
        "lora_alpha": 64,
        "target_modules": "all-linear",
        "lora_dropout": 0.05,
        "task_type": "CAUSAL_LM",
    }
    assert got["TrainingArguments"] == {
        "output_dir": "out",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "optim": "paged_adamw_8bit",
        "bf16": True,
    }


@pytest.mark.parametrize(("version", "reentrant"), [("4.44", True), ("5.25", False)])
def test_checkpointing_is_written_as_counted(spec_of, version, reentrant):
    """The snippet's use_reentrant is the checkpointing ckplan counted (transformers 4.44's
    default is reentrant, 5.25's not; bitsandbytes' int8 matmul inputs outlive only the latter,
    docs/fine-tuning.md)."""
    spec = spec_of(
        "llama3-8b", **LLAMA, training="lora", weight_format="int8", framework_version=version
    )
    args = calls(exports.export(plan_of(spec, "full"), "peft").text)["TrainingArguments"]
    assert args["gradient_checkpointing_kwargs"] == {"use_reentrant": reentrant}


@pytest.mark.parametrize(
    ("changes", "optim"),
    [
        ({"framework_version": "4.44"}, "adamw_torch"),  # v4.44's default: foreach
        ({"framework_version": "4.44", "optimizer_implementation": "fused"}, "adamw_torch_fused"),
        ({"optimizer_implementation": "foreach"}, "adamw_torch"),
        ({}, "adamw_torch_fused"),
    ],
)
def test_optim_is_the_counted_step(spec_of, changes, optim):
    """The AdamW path whose step ckplan counted: foreach's copy of exp_avg_sq or the fused
    kernel's none (`optimizer_implementation`)."""
    spec = spec_of("llama3-8b", **LLAMA, **changes)
    args = calls(exports.export(plan_of(spec, "full"), "peft").text)["TrainingArguments"]
    assert args["optim"] == optim


@pytest.mark.parametrize(
    ("optimizer", "optim"),
    [
        ("adamw", "adamw_torch_fused"),
        ("adamw-8bit", "adamw_8bit"),
        ("adafactor", "adafactor"),
        ("sgd-nomomentum", "sgd"),
        ("lion", "lion_32bit"),
        ("adamw-bf16", "adamw_anyprecision"),
    ],
)
def test_optim_names(spec_of, optimizer, optim):
    spec = spec_of("llama3-8b", **LLAMA, training="lora", optimizer=optimizer)
    got = calls(exports.export(plan_of(spec, "none"), "peft").text)
    args = got["TrainingArguments"]
    assert args["optim"] == optim
    assert args["gradient_checkpointing"] is False
    assert "gradient_checkpointing_kwargs" not in args
    assert got["LoraConfig"]["target_modules"] == ["q_proj", "v_proj"]
    assert got["LoraConfig"]["lora_alpha"] == 8  # PEFT's default when lora_alpha is not given
    assert "BitsAndBytesConfig" not in got


def test_full_fine_tune_has_no_lora_config(spec_of):
    spec = spec_of("llama3-8b", **LLAMA, dp=4, zero=3)
    got = calls(exports.export(plan_of(spec, "full"), "peft").text)
    assert "LoraConfig" not in got and "BitsAndBytesConfig" not in got
    assert got["TrainingArguments"]["fsdp"] == "full_shard"


@pytest.mark.parametrize(
    ("changes", "strategy", "fragment"),
    [
        ({}, "uniform:2", "recomputes every layer (one per checkpoint) or none"),
        ({}, "selective", "wraps whole decoder layers"),
        ({"framework": "megatron", "tp": 2}, "full", "tp=2: the Trainer runs data parallelism"),
        ({"framework": "megatron", "pp": 2}, "full", "pp=2"),
        ({"training": "full", "optimizer": "sgd"}, "full", "without momentum"),
        ({"optimizer_in_backward": True, "microbatches": 1}, "full", "steps after backward"),
    ],
)
def test_refusals(spec_of, changes, strategy, fragment):
    spec = spec_of("llama3-8b", **{**LLAMA, **changes})
    plan = plan_of(spec, strategy)
    with pytest.raises(ExportError, match=re.escape(fragment)) as error:
        exports.export(plan, "peft")
    assert "\n" not in str(error.value)


def test_cli(cli):
    code, out, err = cli(
        "export",
        "llama3-8b",
        "--plan",
        "full",
        "--to",
        "peft",
        "--set",
        "framework=hf",
        "--set",
        "training=qlora",
    )
    assert code == 0, err
    assert calls(out)["BitsAndBytesConfig"]["load_in_4bit"] is True
    code, _, err = cli("export", "llama3-8b", "--plan", "uniform:4", "--to", "peft")
    assert code == 2 and "nearest expressible plan" in err


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers v5's new argument names
def test_objects_construct(spec_of, tmp_path):
    """The snippet runs against the installed libraries (optional: skipped without them)."""
    framework_or_skip("peft")
    framework_or_skip("transformers")
    spec = spec_of("llama3-8b", **LLAMA, training="lora", lora_targets="all-linear")
    namespace = run_snippet(spec, tmp_path)
    args, lora = namespace["training_args"], namespace["lora_config"]
    assert args.per_device_train_batch_size == 2 and args.gradient_accumulation_steps == 4
    assert args.gradient_checkpointing is True and str(args.optim.value) == "adamw_torch_fused"
    assert lora.r == 16 and lora.task_type == "CAUSAL_LM"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_qlora_snippet_and_every_optim_construct(spec_of, tmp_path):
    """The QLoRA snippet's BitsAndBytesConfig and TrainingArguments construct, and every optim
    the export writes is one of transformers' OptimizerNames (optional, as above)."""
    framework_or_skip("peft")
    transformers = framework_or_skip("transformers")
    from ckplan.exports.peft import OPTIM

    names = {name.value for name in transformers.training_args.OptimizerNames}
    assert set(OPTIM.values()) <= names
    spec = spec_of("llama3-8b", **LLAMA, training="qlora", optimizer="paged-adamw-8bit")
    namespace = run_snippet(spec, tmp_path)
    bnb = namespace["bnb_config"]
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant
    assert str(namespace["training_args"].optim.value) == "paged_adamw_8bit"


def test_an_unquantised_model_loads_in_the_dtype_its_weights_were_counted_in(spec_of):
    """from_pretrained's default dtype changed (float32 up to transformers v4.57, the
    checkpoint's from v5): the snippet names the one ckplan counted, and leaves a 4-bit model's
    to bitsandbytes and prepare_model_for_kbit_training."""
    fp32 = exports.export(plan_of(spec_of("llama3-8b", training="lora"), "full"), "peft").text
    assert "from_pretrained(NAME, dtype=torch.float32)" in fp32 and "import torch" in fp32
    bf16 = spec_of("llama3-8b", training="lora", weight_bytes=2, weight_format="bf16")
    text = exports.export(plan_of(bf16, "full"), "peft").text
    assert "from_pretrained(NAME, dtype=torch.bfloat16)" in text
    qlora = exports.export(plan_of(spec_of("llama3-8b", training="qlora"), "full"), "peft").text
    assert "from_pretrained(NAME, quantization_config=bnb_config)" in qlora
    assert "from_pretrained(NAME, dtype" not in qlora


SHARDED_QLORA = dict(
    framework="hf", seq=1024, micro_batch=2, microbatches=1, dp=2, zero=3, training="qlora",
    weight_format="nf4", optimizer_offload="cpu", param_offload="cpu",
)  # fmt: skip
BF16_STATES = dict(weight_bytes=2, grad_bytes=2, master_bytes=0, optimizer="adamw-bf16")


def test_sharded_qlora_with_cpu_offload(spec_of):
    """PEFT's FSDP-QLoRA recipe: FSDP's CPU offload as `fsdp="full_shard offload"`, the 4-bit
    weights stored in bf16 so that FSDP can flatten them with the rest, the model loaded in it
    and not prepared (TRL's sharded-QLoRA path), the adapters kept in bf16; with bf16 states
    counted, torch's AdamW; otherwise a note saying what ckplan counted."""
    spec = spec_of("llama3-8b", **SHARDED_QLORA, **BF16_STATES)
    result = exports.export(plan_of(spec, "full"), "peft")
    found = calls(result.text)
    assert found["TrainingArguments"]["fsdp"] == "full_shard offload"
    assert found["TrainingArguments"]["optim"] == "adamw_torch_fused"
    assert found["BitsAndBytesConfig"]["bnb_4bit_quant_storage"] == "torch.bfloat16"
    assert "dtype=torch.bfloat16" in result.text and "prepare_model_for_kbit" not in result.text
    assert "autocast_adapter_dtype=False" in result.text
    assert not any("weight_bytes" in note for note in result.notes)
    counted_fp32 = spec_of("llama3-8b", **SHARDED_QLORA)
    notes = exports.export(plan_of(counted_fp32, "full"), "peft").notes
    assert any("--set weight_bytes=2" in note for note in notes)
    single = spec_of("llama3-8b", **LLAMA, training="qlora")
    assert "bnb_4bit_quant_storage" not in exports.export(plan_of(single, "full"), "peft").text


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sharded_qlora_arguments_construct(spec_of, tmp_path):
    """transformers reads `fsdp="full_shard offload"` as FSDP with cpu_offload (optional)."""
    framework_or_skip("transformers")
    spec = spec_of("llama3-8b", **SHARDED_QLORA, **BF16_STATES)
    namespace = run_snippet(spec, tmp_path)
    args = namespace["training_args"]
    assert args.fsdp_config["cpu_offload"] is True and args.fsdp_config["version"] == 2
    assert str(namespace["bnb_config"].bnb_4bit_quant_storage) == "torch.bfloat16"
    # FSDP2 under transformers 5.25 by default; FSDP1 where the plan says so, as it was counted
    fsdp1 = run_snippet(spec.replace(fsdp_version=1), tmp_path)["training_args"]
    assert fsdp1.fsdp_config["version"] == 1


def test_backward_prefetch_is_written_to_fsdp_config(spec_of):
    fsdp1 = dict(SHARDED_QLORA, fsdp_version=1)
    spec = spec_of("llama3-8b", **fsdp1, fsdp_backward_prefetch="backward_pre")
    found = calls(exports.export(plan_of(spec, "full"), "peft").text)
    config = found["TrainingArguments"]["fsdp_config"]
    assert config == {"version": 1, "backward_prefetch": "backward_pre"}
    plain = calls(exports.export(plan_of(spec_of("llama3-8b", **fsdp1), "full"), "peft").text)
    assert plain["TrainingArguments"]["fsdp_config"] == {"version": 1}  # FSDP1, as counted
    default = spec_of("llama3-8b", **SHARDED_QLORA)  # transformers 5.25's Trainer: FSDP2
    found = calls(exports.export(plan_of(default, "full"), "peft").text)
    assert found["TrainingArguments"]["fsdp_config"] == {"version": 2}
    old = spec_of("llama3-8b", **SHARDED_QLORA, framework_version="4.44")
    found = calls(exports.export(plan_of(old, "full"), "peft").text)
    assert found["TrainingArguments"]["fsdp_config"] == {"version": 1}
