"""Frozen weights, LoRA and QLoRA (ckplan.model.finetune, docs/fine-tuning.md): the op table,
the parameters and the model states of a small Llama-style model, by hand, to the byte."""

import json

import pytest

from ckplan.cli import main
from ckplan.errors import InputError
from ckplan.model.finetune import (
    adapter_tensor_elements,
    dequantize_4bit_bytes,
    dequantize_8bit_bytes,
    gathered_layer_bytes,
    gathered_weight_bytes,
    held_through_checkpoint_bytes,
    int8_forward_bytes,
    int8_transposed_input_bytes,
    matmul_4bit_keeps_input,
    matmul_8bit_keeps_transposed_input,
    quantization_statistics_bytes,
    quantized_weight_bytes,
)
from ckplan.model.flops import layer_backward_flops
from ckplan.model.frameworks import checkpoint_reentrant
from ckplan.model.memory import (
    activation_bytes_by_op,
    layer_backward_walk,
    model_state_bytes,
    parameter_count,
)
from ckplan.model.ops import layer_ops
from ckplan.model.spec import spec_from_mapping
from ckplan.plan import evaluate, parse_strategy

# s 16, b 2, h 64, a 4, g 2 (d 16), F 128, B 2: 32 tokens, a residual-stream tensor 4,096 bytes
SMALL = {
    "name": "small",
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "ffn_hidden": 128,
    "vocab": 256,
    "seq": 16,
    "micro_batch": 2,
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention": "flash",
    "positions": "rope",
    "bias": False,
}
TOKENS, X = 32, 2 * 32 * 64


def small(**changes):
    return spec_from_mapping({**SMALL, **changes})


def test_frozen_linears_save_no_input_but_flash_attention_output():
    full = activation_bytes_by_op(small())
    frozen = activation_bytes_by_op(small(training="frozen"))
    assert full["qkv_proj"] == X and full["fc1"] == X and full["fc2"] == 2 * TOKENS * 128
    assert frozen["qkv_proj"] == frozen["fc1"] == frozen["fc2"] == 0
    # out_proj's input is the attention output O, which the flash kernel saves anyway
    assert frozen["out_proj"] == full["out_proj"] == 2 * TOKENS * 64
    for op in ("norm1", "attention_core", "norm2", "act"):
        assert frozen[op] == full[op]


def test_frozen_standard_attention_out_proj_saves_nothing():
    frozen = activation_bytes_by_op(small(training="frozen", attention="standard"))
    assert frozen["out_proj"] == 0


def test_lora_on_q_and_v_by_hand():
    """r 8 on q_proj (64 -> 64) and v_proj (64 -> 32), no dropout: the two adapters read the
    norm's output, one storage kept with qkv_proj; each saves its r-wide A output."""
    spec = small(training="lora", lora_rank=8)
    saved = activation_bytes_by_op(spec)
    assert saved["qkv_proj"] == X
    assert saved["qkv_proj_lora"] == 2 * (2 * TOKENS * 8)  # 1,024
    assert saved["fc1"] == saved["fc2"] == 0
    assert "fc1_lora" not in saved
    ops = {op.name: op for op in spec_ops(spec)}
    # q: 2·32·8·64 + 2·32·64·8, v: 2·32·8·64 + 2·32·32·8
    assert ops["qkv_proj_lora"].forward_flops == 65_536 + 49_152
    assert ops["qkv_proj_lora"].backward_flops == 2 * (65_536 + 49_152)
    # the frozen projection: the input gradient's GEMM only
    qkv = 2 * TOKENS * (64 + 2 * 32) * 64
    assert ops["qkv_proj"].forward_flops == ops["qkv_proj"].backward_flops == qkv
    # trainable: r·(in + out) per adapter, 8·128 + 8·96 per layer, two layers
    assert parameter_count(spec).trainable == 2 * (8 * 128 + 8 * 96)
    assert parameter_count(spec).total == parameter_count(small()).total


def test_lora_dropout_saves_a_copy_and_a_mask_per_adapter():
    spec = small(training="lora", lora_rank=8, lora_dropout=0.1)
    saved = activation_bytes_by_op(spec)
    assert saved["qkv_proj"] == 0  # the adapters save their dropout outputs instead
    assert saved["qkv_proj_lora"] == 2 * (2 * TOKENS * 8 + (2 + 1) * TOKENS * 64)


def test_bitsandbytes_keeps_the_4bit_matmul_input_before_0_43_2():
    """MatMul4Bit's `ctx.tensors = (A, B)` in 0.43.0 and 0.43.1, `(None, B)` from 0.43.2."""
    assert matmul_4bit_keeps_input("0.43.0") and matmul_4bit_keeps_input("0.43.1")
    assert matmul_4bit_keeps_input("0.42.0")
    assert not matmul_4bit_keeps_input("0.43.2") and not matmul_4bit_keeps_input("0.45.5")
    assert not matmul_4bit_keeps_input("1.0") and not matmul_4bit_keeps_input(None)


def test_qlora_under_bitsandbytes_0_43_0_keeps_each_4bit_linear_input():
    """QLoRA on every linear with dropout: the adapters save their dropout outputs, so a current
    bitsandbytes keeps no linear input; 0.43.0 keeps qkv_proj's and fc1's normed x (X each) and
    fc2's F-wide input (2 bytes · 32 tokens · 128); out_proj's input, the flash kernel's saved
    output, is counted once either way."""
    keys = {"training": "qlora", "lora_rank": 8, "lora_dropout": 0.1, "lora_targets": "all-linear"}
    current = activation_bytes_by_op(small(**keys))
    old = activation_bytes_by_op(small(**keys, bitsandbytes_version="0.43.0"))
    assert current["qkv_proj"] == current["fc1"] == current["fc2"] == 0
    assert old["qkv_proj"] == old["fc1"] == X and old["fc2"] == 2 * TOKENS * 128
    assert old["out_proj"] == current["out_proj"] == 2 * TOKENS * 64
    assert sum(old.values()) - sum(current.values()) == 2 * X + 2 * TOKENS * 128
    # the same release under a bf16 LoRA runs no 4-bit matmul: the key needs 4-bit weights
    with pytest.raises(InputError, match="bitsandbytes_version"):
        small(training="lora", bitsandbytes_version="0.43.0")
    with pytest.raises(InputError, match="bitsandbytes_version"):
        small(training="qlora", bitsandbytes_version="latest")


def test_int8_linears_keep_their_input_and_before_0_45_a_transposed_int8_copy():
    """LLM.int8(): MatMul8bitLt keeps its input in ctx.tensors in every release (checked on the
    CPU for 0.44.1, 0.45.5 and 0.50.1 by validation/bitsandbytes_matmul8bit_input.py), so with
    dropout on every adapter (whose dropout outputs are other storages) each int8 linear op
    still keeps its input: qkv_proj's and fc1's normed x (X each), fc2's F-wide input; where a
    bf16 LoRA keeps none. Before 0.45.0 every int8 linear also keeps CAt, one int8 per input
    value, and SCAt, an fp32 per input feature: q, k and v each quantise the normed x, gate and
    up too."""
    keys = {"training": "lora", "lora_rank": 8, "lora_dropout": 0.1, "lora_targets": "all-linear"}
    bf16 = activation_bytes_by_op(small(**keys))
    int8 = activation_bytes_by_op(small(**keys, weight_format="int8"))
    old = activation_bytes_by_op(small(**keys, weight_format="int8", bitsandbytes_version="0.44.1"))
    assert bf16["qkv_proj"] == bf16["fc1"] == bf16["fc2"] == 0
    assert int8["qkv_proj"] == int8["fc1"] == X and int8["fc2"] == 2 * TOKENS * 128
    assert int8["out_proj"] == bf16["out_proj"] == 2 * TOKENS * 64  # the flash output, once
    assert int8_transposed_input_bytes(TOKENS, 64) == TOKENS * 64 + 4 * 64
    assert old["qkv_proj"] - int8["qkv_proj"] == 3 * (TOKENS * 64 + 4 * 64)
    assert old["fc1"] - int8["fc1"] == 2 * (TOKENS * 64 + 4 * 64)
    assert old["fc2"] - int8["fc2"] == TOKENS * 128 + 4 * 128
    assert old["out_proj"] - int8["out_proj"] == TOKENS * 64 + 4 * 64
    # LoRA on q and v without dropout: the untargeted MLP's int8 linears keep their inputs
    plain = activation_bytes_by_op(small(training="lora", weight_format="int8"))
    assert plain["fc1"] == X and plain["fc2"] == 2 * TOKENS * 128
    assert matmul_8bit_keeps_transposed_input("0.44.1")
    assert matmul_8bit_keeps_transposed_input("0.41.0")
    assert not matmul_8bit_keeps_transposed_input("0.45.0")
    assert not matmul_8bit_keeps_transposed_input("0.50.1")
    assert not matmul_8bit_keeps_transposed_input(None)
    with pytest.raises(InputError, match="nf4, fp4 or int8"):
        small(training="lora", bitsandbytes_version="0.44.1")


def test_checkpointing_is_reentrant_where_the_framework_release_says():
    """transformers v4.44.2 defaults gradient checkpointing to use_reentrant=True, v5.25.0 to
    False; DeepSpeed's 2021 path and Megatron-LM checkpoint through an autograd.Function."""
    assert checkpoint_reentrant(small(framework="hf", framework_version="4.44"))
    assert not checkpoint_reentrant(small(framework="hf", framework_version="5.25"))
    assert not checkpoint_reentrant(small(framework="hf"))  # the newest release modelled
    assert checkpoint_reentrant(small(framework="deepspeed", framework_version="0.5.4", zero=3))
    assert checkpoint_reentrant(small(framework="megatron"))
    assert not checkpoint_reentrant(small(framework="torchtitan"))
    # the key says instead of the release
    assert checkpoint_reentrant(small(framework="hf", checkpoint_reentrant=True))
    assert not checkpoint_reentrant(
        small(framework="hf", framework_version="4.44", checkpoint_reentrant=False)
    )


def test_int8_inputs_outlive_non_reentrant_checkpoints_and_offloading():
    """bitsandbytes' MatMul8bitLt holds each input on its autograd node, which non-reentrant
    checkpointing and offloading act around (their saved-tensor hooks see what autograd saves,
    not a node's attributes; validation/bitsandbytes_matmul8bit_input.py checks it on the CPU):
    with full recomputation under transformers 5.25 every layer keeps its int8 linears' inputs
    beside its checkpointed input, X for qkv_proj's and fc1's normed x, the attention output
    for out_proj, the F-wide input of fc2; under 4.44's reentrant checkpointing, none. A bf16
    LoRA keeps none either way. Offloading every tape leaves them on the GPU whatever the
    checkpointing."""
    keys = {"training": "lora", "weight_format": "int8", "framework": "hf", "layers": 4}
    current, old = small(**keys), small(**keys, framework_version="4.44")
    per_layer = X + 2 * TOKENS * 64 + X + 2 * TOKENS * 128
    assert held_through_checkpoint_bytes(layer_ops(current), current) == per_layer
    plain = small(training="lora")
    assert held_through_checkpoint_bytes(layer_ops(plain), plain) == 0
    full = evaluate(current, parse_strategy("full", current))
    reentrant = evaluate(old, parse_strategy("full", old))
    assert full.activation_bytes - reentrant.activation_bytes == 4 * per_layer
    assert any("includes" in note and "4 recomputed layers" in note for note in full.notes)
    assert not any("bitsandbytes" in note for note in reentrant.notes)
    bf16 = small(**{**keys, "weight_format": "bf16"})
    assert not any("bitsandbytes" in n for n in evaluate(bf16, parse_strategy("full", bf16)).notes)
    offloaded = evaluate(old, parse_strategy("offload", old))
    assert any("offloaded or recomputed layers" in note for note in offloaded.notes)


def test_optimal_plans_beside_the_held_int8_inputs():
    """`optimal` under a budget between full recomputation's peak and storing everything: the
    inputs bitsandbytes holds through non-reentrant checkpoints come beside the DP's schedule,
    and the plan it returns stays within the budget with them."""
    spec = small(training="lora", weight_format="int8", framework="hf", layers=8)
    full = evaluate(spec, parse_strategy("full", spec)).activation_bytes
    none = evaluate(spec, parse_strategy("none", spec)).activation_bytes
    budget = (full + none) // 2
    plan = evaluate(spec, parse_strategy("optimal", spec), budget=budget)
    assert plan is not None and full <= plan.activation_bytes <= budget
    assert any("includes" in note for note in plan.notes)


def test_int8_linears_move_their_quantisation_and_the_weights_dequantisation():
    """bitsandbytes 0.45.5's MatMul8bitLt beside its GEMM, bf16 activations, per input value:
    the fp16 cast (2 + 2), the outlier search at threshold 6 (abs 2 + 2, >= 2 + 1, two any()
    1 + 1), the quantisation (2 + 1): 16; per row an fp32 scale; per output value the
    dequantisation (4 + 2) and the bf16 cast (2 + 2): 10; both scale vectors read. Backward:
    the int8 codes copied to bf16 (1 + 2) and scaled in place (2 + 2) per weight value, the
    scale vector made (4 + 4) and read (4) per row. Under fp16 activations no cast runs."""
    assert int8_forward_bytes(32, 64, 16, 2, fp16=False) == (
        32 * 64 * 16 + 4 * 32 + 32 * 16 * 10 + 4 * (32 + 16)
    )
    assert int8_forward_bytes(32, 64, 16, 2, fp16=True) == (
        32 * 64 * 12 + 4 * 32 + 32 * 16 * 6 + 4 * (32 + 16)
    )
    assert dequantize_8bit_bytes(64, 16, 2) == 64 * 16 * 7 + 12 * 16
    ops = {op.name: op for op in spec_ops(small(training="lora", weight_format="int8"))}
    base = {op.name: op for op in spec_ops(small(training="lora"))}
    qkv_forward = sum(int8_forward_bytes(TOKENS, 64, out, 2, fp16=False) for out in (64, 32, 32))
    assert ops["qkv_proj"].forward_bytes == base["qkv_proj"].forward_bytes + qkv_forward
    assert ops["qkv_proj"].backward_bytes == sum(
        dequantize_8bit_bytes(64, out, 2) for out in (64, 32, 32)
    )
    assert ops["fc2"].backward_bytes == dequantize_8bit_bytes(128, 64, 2)
    assert ops["fc1"].forward_flops == base["fc1"].forward_flops  # the GEMM at the BF16 rate


def test_all_linear_targets_every_linear_of_the_layer():
    spec = small(training="lora", lora_rank=4, lora_targets="all-linear")
    saved = activation_bytes_by_op(spec)
    per_adapter = 2 * TOKENS * 4
    assert saved["qkv_proj_lora"] == 3 * per_adapter
    assert saved["out_proj_lora"] == per_adapter
    assert saved["fc1_lora"] == 2 * per_adapter  # gate_proj and up_proj
    assert saved["fc2_lora"] == per_adapter
    assert saved["fc1"] == X and saved["fc2"] == 2 * TOKENS * 128  # inputs the adapters read
    widths = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]
    assert parameter_count(spec).trainable == 2 * sum(4 * (i + o) for i, o in widths)


def test_lora_targets_spellings():
    assert small(training="lora", lora_targets="v_proj, q_proj,q_proj").lora_targets == (
        "q_proj,v_proj"
    )
    assert small(training="lora", lora_targets=["down_proj", "o_proj"]).lora_targets == (
        "o_proj,down_proj"
    )
    assert small(training="lora", lora_targets="ALL-LINEAR").lora_targets == "all-linear"
    gelu = small(training="lora", mlp="gelu", lora_targets="all-linear", lora_rank=2)
    assert "fc1_lora" in activation_bytes_by_op(gelu)  # up_proj alone on a GELU MLP


def test_backward_walk_stays_consistent():
    """Every gradient read, every saved tensor freed (the walk checks it) and the adapters'
    backward temporaries counted where they run."""
    for changes in (
        {"training": "frozen"},
        {"training": "lora", "lora_targets": "all-linear"},
        {"training": "qlora", "lora_dropout": 0.1, "lora_targets": "all-linear"},
    ):
        points = {point.op: point for point in layer_backward_walk(small(**changes))}
        assert points["fc2"].live_bytes > 0
    points = {p.op: p for p in layer_backward_walk(small(training="lora", lora_rank=8))}
    # per adapter: the scaled product's gradient (out), A's output gradient (r), dX (in)
    assert points["qkv_proj_lora"].workspace_bytes == 2 * TOKENS * (64 + 8 + 64)


def test_frozen_backward_flops_drop_the_weight_gradients():
    full, frozen = small(), small(training="frozen")
    linears = sum(op.forward_flops for op in spec_ops(full) if op.name != "attention_core")
    assert layer_backward_flops(full) - layer_backward_flops(frozen) == linears


def test_nf4_bytes_of_a_4096_square_weight():
    """16,777,216 values: 8,388,608 packed bytes, 262,144 8-bit block absmax, 1,024 fp32
    second-level absmax, an fp32 offset, the 16 fp32 code values."""
    assert quantized_weight_bytes(4096, 4096, "nf4") == 8_388_608 + 262_144 + 4_096 + 4 + 64
    assert quantized_weight_bytes(4096, 4096, "fp4") == quantized_weight_bytes(4096, 4096, "nf4")
    assert quantized_weight_bytes(4096, 1024, "int8") == 4096 * 1024 + 4 * 1024
    assert quantized_weight_bytes(3, 5, "nf4") == 8 + 1 + 4 + 4 + 64
    assert quantized_weight_bytes(10, 10, "bf16") == 200
    assert quantized_weight_bytes(10, 10, "fp32") == 400


def test_frozen_states_hold_the_weights_only():
    spec = small(training="frozen")
    states = model_state_bytes(spec)
    assert states.gradients == states.optimizer == 0
    assert states.weights == 2 * parameter_count(spec).total


def test_qlora_states_by_hand():
    """The linears in nf4; norms, embedding and output at weight_bytes (2); the adapters at
    2 + 4 + 4 + 8 (Megatron-LM's recipe)."""
    spec = small(training="qlora", lora_rank=8, framework="megatron")
    assert spec.weight_format == "nf4"
    linears = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]
    per_layer = sum(quantized_weight_bytes(i, o, "nf4") for i, o in linears)
    rest = 2 * 256 * 64 + 64 + 2 * 2 * 64  # embedding, output, final norm, layers' norms
    adapters = 2 * (8 * 128 + 8 * 96)
    states = model_state_bytes(spec)
    assert states.weights == 2 * per_layer + 2 * rest + 2 * adapters
    assert states.gradients == 4 * adapters
    assert states.optimizer == 12 * adapters


def test_lora_on_llama3_8b_matches_peft_trainable_counts():
    """PEFT's print_trainable_parameters on Meta-Llama-3-8B, r 16: 6,815,744 for q_proj and
    v_proj, 41,943,040 for all-linear."""
    from ckplan.inputs.presets import load_spec

    qv = load_spec("llama3-8b", {"training": "lora"})
    assert parameter_count(qv).trainable == 6_815_744
    every = load_spec("llama3-8b", {"training": "lora", "lora_targets": "all-linear"})
    assert parameter_count(every).trainable == 41_943_040


def test_zero3_shards_the_frozen_weights():
    one = model_state_bytes(small(training="lora", framework="torchtitan"))
    four = model_state_bytes(small(training="lora", framework="torchtitan", dp=4, zero=3))
    assert four.weights < one.weights and four.gradients == -(-one.gradients // 4)


def test_nf4_statistics_are_what_the_weight_holds_beyond_its_packed_values():
    """Llama-2-70B's gate_proj, 8192 x 28672 = 234,881,024 values: 3,670,016 8-bit block
    absmax, 14,336 fp32 second-level absmax, an fp32 offset and the 16 fp32 code values."""
    assert quantization_statistics_bytes(8192, 28672, "nf4") == 3_670_016 + 4 * 14_336 + 4 + 64
    assert quantization_statistics_bytes(64, 64, "fp4") == 64 + 4 + 4 + 64
    assert quantization_statistics_bytes(64, 64, "bf16") == 0
    assert quantization_statistics_bytes(64, 64, "int8") == 0


def test_zero3_keeps_the_nf4_statistics_whole_on_every_rank():
    """QLoRA under DeepSpeed ZeRO-3 over 4 ranks: the packed nf4 values (18,432 bytes a layer),
    the embedding, output and norms (33,088 values in bf16) are split; each layer's 1,080
    bytes of statistics (136 + 104 + 104 + 136 + 200 + 200 + 200, `quantization_statistics_
    bytes`) stay whole; the adapters (3,584 values in bf16) are split."""
    spec = small(training="qlora", lora_rank=8, framework="deepspeed", dp=4, zero=3)
    packed, statistics, rest, adapters = 2 * 18_432, 2 * 1_080, 2 * 33_088, 2 * 3_584
    assert model_state_bytes(spec).weights == (packed + rest) // 4 + statistics + adapters // 4


def test_zero3_gathers_a_4bit_weight_as_its_packed_storage():
    """Llama-2-70B's gate_proj (234,881,024 values): 117,440,512 packed bytes, int8 one byte
    a value, bf16 two, fp32 four; the small model's QLoRA layer: 18,432 packed bytes and its
    adapters' 1,792 values in bf16, the largest weight 128 x 64 packed."""
    assert gathered_weight_bytes(8192, 28672, "nf4", 2) == 117_440_512
    assert gathered_weight_bytes(8192, 28672, "int8", 2) == 234_881_024
    assert gathered_weight_bytes(8192, 28672, "bf16", 4) == 469_762_048
    assert gathered_weight_bytes(8192, 28672, None, 2) == 469_762_048
    assert gathered_weight_bytes(3, 5, "fp32", 2) == 60
    spec = small(training="qlora", lora_rank=8, framework="deepspeed", dp=4, zero=3)
    assert gathered_layer_bytes(spec, 2) == (18_432 + 2 * 1_792, 4_096)


def test_adapter_tensors_of_a_layer():
    """The small model's q_proj (64 -> 64) and v_proj (64 -> 32) at r 8: A 8 x 64 each, B 64 x 8
    and 32 x 8; DoRA adds the magnitudes, 64 and 32."""
    assert adapter_tensor_elements(small(training="lora", lora_rank=8)) == (512, 512, 512, 256)
    dora = small(training="lora", lora_rank=8, use_dora=True)
    assert adapter_tensor_elements(dora) == (512, 512, 64, 512, 256, 32)


def test_estimate_shows_the_trainable_parameters(capsys):
    code = main(["estimate", "llama3-8b", "--set", "training=lora", "--set", "lora_rank=16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "trainable" in out and "6,815,744" in out and "q_proj,v_proj" in out
    argv = ["estimate", "llama3-8b", "--set", "training=qlora", "--set", "framework=megatron"]
    code = main([*argv, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["parameters"]["trainable"] == 6_815_744
    assert data["memory"]["model_states"]["gradients"] == 4 * 6_815_744


def test_adapters_default_to_the_trainer_on_a_data_parallel_layout(capsys):
    """A model that names no framework trains LoRA and QLoRA under Hugging Face's Trainer with
    PEFT (Megatron-LM's arguments have no adapters), and every weight under Megatron-LM, as do
    adapters on a layout the Trainer does not run (model parallelism, ZeRO 1); a named
    framework stays."""
    assert small(training="lora").framework == "hf"
    assert small(training="qlora", dp=4, zero=3).framework == "hf"
    assert small(training="full").framework == small(training="frozen").framework == "megatron"
    assert small(training="lora", pp=2).framework == small(training="lora", cp=2).framework
    assert small(training="lora", pp=2).framework == "megatron"
    assert small(training="lora", dp=2, zero=1).framework == "megatron"  # the Trainer: 0, 2, 3
    assert small(training="lora", framework="torchtitan").framework == "torchtitan"
    code = main(["estimate", "llama3-8b", "--set", "training=qlora", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["model"]["framework"] == "hf" and data["model"]["kernels"] == "eager"
    # the Trainer's fp32 norms, embedding and output beside the nf4 linears (4 B/param)
    hf = model_state_bytes(small(training="qlora", lora_rank=8))
    megatron = model_state_bytes(small(training="qlora", lora_rank=8, framework="megatron"))
    assert hf.weights > megatron.weights


@pytest.mark.parametrize("strategy", ["full", "selective", "mlp+uniform:2", "optimal"])
def test_every_strategy_reads_the_same_table(strategy, capsys):
    argv = ["estimate", "llama3-8b", "--set", "training=qlora", "-s", strategy, "--json"]
    argv += ["--budget", "24GB"] if strategy == "optimal" else []
    code = main(argv)
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 1)
    assert data["memory"]["per_op"]["fc1"] == 0


def spec_ops(spec):
    from ckplan.model.ops import layer_ops

    return layer_ops(spec)


def test_published_lora_runs_translate_into_fine_tuning_keys():
    """The torchtune and PEFT LoRA/QLoRA runs become specs with their rank, targets (torchtune's
    output_proj, w1, w2, w3 as o_proj, gate_proj, down_proj, up_proj) and weight format; the
    run with FSDP's CPU offload (accelerate's fsdp_offload_params, two micro-batches under
    no_sync) as both model-state offload keys beside its frozen 4-bit weights."""
    from ckplan.published.predict import run_spec, unmodelled
    from ckplan.published.suite import suite_runs

    runs = [run for run in suite_runs() if run.training.get("training", "full") != "full"]
    assert len(runs) >= 2
    for run in runs:
        spec = run_spec(run)
        assert spec.training == run.training["training"]
        assert spec.lora_rank == run.training["lora"]["rank"]
        reason = unmodelled(run) or ""
        assert "training" not in reason and "weight_format" not in reason
    offloaded = next(run for run in runs if run.name.endswith("fsdp-cpu-offload-2gpu"))
    spec = run_spec(offloaded)
    assert (spec.optimizer_offload, spec.param_offload, spec.microbatches) == ("cpu", "cpu", 2)
    torchtune = next(run for run in runs if run.name.startswith("torchtune-llama3.2-3b-qlora"))
    spec = run_spec(torchtune)
    assert spec.weight_format == "nf4"
    assert spec.lora_targets == "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def test_a_frozen_output_layer_keeps_no_input_and_no_weight_gradient():
    from ckplan.model.loss import output_saved_bytes
    from ckplan.plan.layer_chain import layer_chain

    full, lora = small(), small(training="lora")
    assert output_saved_bytes(full) - output_saved_bytes(lora) == X
    logits = 2 * TOKENS * 256 * 64
    assert layer_chain(full, False).backward_flops[-1] == 2 * logits
    assert layer_chain(lora, False).backward_flops[-1] == logits


def test_plan_searches_tp_1_for_lora_and_exports_say_what_they_carry(capsys):
    code = main(["plan", "llama3-8b", "--set", "training=lora", "--gpus", "8", "--gpu", "h100-sxm"])
    out = capsys.readouterr().out
    assert code == 0 and "Fastest: tp 1" in out
    code = main(["export", "llama3-8b", "--set", "training=qlora", "-p", "full", "-t", "torch"])
    captured = capsys.readouterr()
    assert code == 0 and "training: qlora" in captured.out + captured.err


def test_model_flops_of_a_fine_tune_skip_the_frozen_weight_gradients():
    """MFU's model FLOPs: 3 x forward less one GEMM per frozen linear and the frozen output
    layer; LoRA adds its adapters' 3 x forward. Per sequence (s 16): q 64, k 32, v 32 wide,
    out 64, gate and up 128 each, down 64 (2·s·in·out FLOPs each), logits 2·16·64·256."""
    from ckplan.model.flops import frozen_weight_gradient_flops, model_flops_per_iteration

    s = 16
    linears = 2 * s * 64 * (64 + 32 + 32) + 2 * s * 64 * 64 + 2 * s * 64 * 256 + 2 * s * 128 * 64
    logits = 2 * s * 64 * 256
    frozen = small(training="frozen")
    assert frozen_weight_gradient_flops(frozen) == 2 * linears + logits
    full = small()
    assert frozen_weight_gradient_flops(full) == 0
    assert model_flops_per_iteration(full, 1) - model_flops_per_iteration(frozen, 1) == (
        2 * linears + logits
    )
    # LoRA r 8 on q and v of both layers: A 64 -> 8 and B 8 -> 64 (q) or 32 (v), trained: 3 x
    # their forward
    lora = small(training="lora", lora_rank=8)
    adapters = 2 * (2 * s * 8 * (64 + 64) + 2 * s * 8 * (64 + 32))
    assert model_flops_per_iteration(lora, 1) == model_flops_per_iteration(frozen, 1) + 3 * adapters


def test_dora_on_q_and_v_by_hand():
    """DoRA r 8 on q_proj (64 -> 64) and v_proj (64 -> 32), no dropout: beside LoRA's A
    outputs, each adapter keeps the base output and B's output (B·tokens·out each) and three
    out-long vectors; forward forms B·A as lora_B(lora_A(eye(64))), with no backward; the
    magnitude vector (out) trains."""
    spec = small(training="lora", lora_rank=8, use_dora=True, framework="megatron")
    saved = activation_bytes_by_op(spec)
    lora = 2 * (2 * TOKENS * 8)
    q = 2 * 2 * TOKENS * 64 + 3 * 2 * 64
    v = 2 * 2 * TOKENS * 32 + 3 * 2 * 32
    assert saved["qkv_proj_lora"] == lora + q + v  # 13,888
    assert saved["qkv_proj"] == X
    ops = {op.name: op for op in spec_ops(spec)}
    adapters = 65_536 + 49_152  # LoRA's, as above
    weight_norm = (2 * 64 * 64 * 8 + 2 * 64 * 8 * 64) + (2 * 64 * 64 * 8 + 2 * 64 * 8 * 32)
    assert ops["qkv_proj_lora"].forward_flops == adapters + weight_norm
    assert ops["qkv_proj_lora"].backward_flops == 2 * adapters
    # the weight norm's tensors: eye(64), A(eye) 64x8, B·A, its scaled copy and the sum (q's)
    assert ops["qkv_proj_lora"].grad_workspace_bytes == 2 * (64 * 64 + 64 * 8 + 3 * 64 * 64)
    assert parameter_count(spec).trainable == 2 * (8 * 128 + 64 + 8 * 96 + 32)
    states = model_state_bytes(spec)  # the magnitudes have gradients and states as A and B
    assert states.gradients == 4 * 3_776 and states.optimizer == 12 * 3_776


def test_dora_with_dropout_runs_the_base_gemm_again():
    """With lora_dropout PEFT's DoRA computes the base output again on the dropped input:
    one more frozen GEMM forward and its input-gradient GEMM backward, per adapter."""
    plain = {op.name: op for op in spec_ops(small(training="lora", lora_rank=8, use_dora=True))}
    spec = small(training="lora", lora_rank=8, use_dora=True, lora_dropout=0.1)
    ops = {op.name: op for op in spec_ops(spec)}
    again = 2 * TOKENS * 64 * 64 + 2 * TOKENS * 64 * 32
    assert ops["qkv_proj_lora"].forward_flops - plain["qkv_proj_lora"].forward_flops == again
    assert ops["qkv_proj_lora"].backward_flops - plain["qkv_proj_lora"].backward_flops == again
    # the dropout output and its 1-byte mask per adapter, as LoRA's
    lora_plain = activation_bytes_by_op(small(training="lora", lora_rank=8, lora_dropout=0.1))
    dora = activation_bytes_by_op(spec)
    lora = activation_bytes_by_op(small(training="lora", lora_rank=8))
    assert dora["qkv_proj_lora"] - lora_plain["qkv_proj_lora"] == (
        activation_bytes_by_op(small(training="lora", lora_rank=8, use_dora=True))["qkv_proj_lora"]
        - lora["qkv_proj_lora"]
    )


def test_dora_model_flops_count_its_forward_only_work_once():
    """MFU's model FLOPs: DoRA's weight norm (B·A) runs forward only, so it adds 1 x its
    forward, not 3 x; per sequence (s 16) and both layers."""
    from ckplan.model.flops import model_flops_per_iteration

    lora = small(training="lora", lora_rank=8)
    dora = small(training="lora", lora_rank=8, use_dora=True)
    weight_norm = (2 * 64 * 64 * 8 + 2 * 64 * 8 * 64) + (2 * 64 * 64 * 8 + 2 * 64 * 8 * 32)
    assert model_flops_per_iteration(dora, 1) - model_flops_per_iteration(lora, 1) == (
        2 * weight_norm
    )


def test_peft_export_writes_use_dora(capsys):
    argv = ["export", "llama3-8b", "--plan", "full", "--to", "peft", "-q"]
    assert main([*argv, "--set", "training=lora", "--set", "use_dora=true"]) == 0
    assert "use_dora=True" in capsys.readouterr().out
    assert main([*argv, "--set", "training=lora"]) == 0
    assert "use_dora" not in capsys.readouterr().out


def test_dora_on_llama3_8b_adds_one_magnitude_per_output_row(capsys):
    """Llama-3-8B, DoRA r 16 on q_proj and v_proj: LoRA's 6,815,744 and the magnitude vectors,
    32 layers x (4,096 + 1,024) values; estimate names DoRA."""
    from ckplan.inputs.presets import load_spec

    spec = load_spec("llama3-8b", {"training": "lora", "use_dora": True})
    assert parameter_count(spec).trainable == 6_815_744 + 32 * (4096 + 1024)
    assert main(["estimate", "llama3-8b", "--set", "training=lora", "--set", "use_dora=true"]) == 0
    assert "DoRA r=16 on q_proj,v_proj" in capsys.readouterr().out


def test_a_4bit_weight_is_dequantised_in_forward_and_again_in_backward():
    """bitsandbytes' MatMul4Bit dequantises the weight to the 2-byte compute dtype in forward
    and in backward for dX: each pass reads the packed values and statistics and writes the
    copy. The small model's q_proj (64 x 64): 2,048 packed bytes, 64 block absmaxes, one fp32
    second-level absmax, an fp32 offset and the 16 fp32 code values, then 8,192 bytes
    written; its qkv_proj op (q 64 x 64, k and v 64 x 32) and fc1 (gate and up, 64 x 128 each)
    move the sums; a bf16 LoRA moves none of it."""
    assert dequantize_4bit_bytes(64, 64, "nf4") == (2_048 + 64 + 4 + 4 + 64) + 2 * 64 * 64
    spec = small(training="qlora", lora_rank=8)
    ops = {op.name: op for op in spec_ops(spec)}
    qkv = sum(dequantize_4bit_bytes(64, out, "nf4") for out in (64, 32, 32))
    fc1 = 2 * dequantize_4bit_bytes(64, 128, "nf4")
    base = {op.name: op for op in spec_ops(small(training="lora", lora_rank=8))}
    assert ops["qkv_proj"].forward_bytes == base["qkv_proj"].forward_bytes + qkv
    assert ops["qkv_proj"].backward_bytes == qkv
    assert ops["fc1"].forward_bytes - base["fc1"].forward_bytes == ops["fc1"].backward_bytes == fc1
    assert ops["fc2"].backward_bytes == dequantize_4bit_bytes(128, 64, "nf4")
    assert base["qkv_proj"].backward_bytes == 0


# ---- a mixture of experts: 4 experts of 32, top 2, a shared expert of 64 -------------------

MOE = {"experts": 4, "top_k": 2, "moe_ffn_hidden": 32, "shared_experts": 1, "shared_ffn_hidden": 64}


def test_frozen_experts_and_router_save_no_input():
    """The router's x (32 tokens x 64), the experts' dispatched rows (64 x 64) and their
    activation's output (64 x 32) leave the table; what routes and combines stays."""
    full = activation_bytes_by_op(small(**MOE, framework="hf"))
    frozen = activation_bytes_by_op(
        small(**MOE, framework="hf", training="lora", lora_targets="q_proj,v_proj")
    )
    rows = TOKENS * 2
    assert (full["router"], full["expert_fc1"], full["expert_fc2"]) == (
        X,
        2 * rows * 64,
        2 * rows * 32,
    )
    for op in ("router", "expert_fc1", "expert_fc2", "shared_fc1", "shared_fc2"):
        assert frozen[op] == 0, op
    for op in ("router_probs", "permute", "expert_act", "unpermute", "shared_act"):
        assert frozen[op] == full[op], op
    assert frozen["qkv_proj"] == X  # q and v adapters read the normed x


def test_frozen_expert_gemms_run_the_input_gradient_alone():
    ops = {op.name: op for op in layer_ops(small(**MOE, training="frozen"))}
    for name in ("router", "expert_fc1", "expert_fc2", "shared_fc1", "shared_fc2"):
        assert ops[name].backward_flops == ops[name].forward_flops > 0, name
    full = {op.name: op for op in layer_ops(small(**MOE))}
    assert full["expert_fc1"].backward_flops == 2 * full["expert_fc1"].forward_flops


def test_frozen_experts_are_weights_and_gathered_with_their_layer():
    """Frozen states hold every weight at weight_bytes (hf's 4), the routed experts'
    4·(64·64 + 32·64) values a layer among them; ZeRO-3 gathers a layer's linears, experts and
    router (here at 2 bytes a value)."""
    spec = small(**MOE, training="lora", lora_targets="q_proj,k_proj,v_proj,o_proj", lora_rank=8)
    counts = parameter_count(spec)
    adapters = 8 * (128 + 96 + 96 + 128)  # q, k, v, o: r·(in + out)
    assert counts.trainable == 2 * adapters
    states = model_state_bytes(spec)
    experts = 4 * (64 * 64 + 32 * 64)
    assert spec.weight_bytes == 4
    assert states.expert_weights == 4 * 2 * experts
    assert states.weights == 4 * (counts.total + counts.trainable)
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64
    shared = 3 * 64 * 64
    router = 64 * 4
    layer, largest = gathered_layer_bytes(spec, 2)
    assert layer == 2 * (attention + shared + experts + router + adapters)
    assert largest == 2 * 64 * 64


def test_frozen_experts_skip_their_weight_gradients_in_the_model_flops():
    from ckplan.model.flops import frozen_weight_gradient_flops

    spec = small(**MOE, training="frozen")
    skipped = frozen_weight_gradient_flops(spec)
    rows = TOKENS // 2 * 2  # one sequence's tokens, each to 2 experts
    per_layer = 2 * 16 * (2 * 64 * 64 + 2 * 64 * 32)  # q, o; k, v
    per_layer += 2 * 16 * 64 * 4 + 2 * rows * 64 * 64 + 2 * rows * 32 * 64  # router, experts
    per_layer += 2 * 16 * 64 * 128 + 2 * 16 * 64 * 64  # the shared expert's fc1 and fc2
    logits = 2 * 16 * 64 * 256
    assert skipped == 2 * per_layer + logits
