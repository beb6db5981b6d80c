"""moe_act_input_fp8: the routed experts' SwiGLU input cached in FP8 and its output recomputed,
DeepSeek-V3 Technical Report (arXiv 2412.19437) §3.3.3, "Low-Precision Activation" (2)."""

import pytest

from ckplan.model.memory import activation_bytes_per_layer as whole_layer
from ckplan.model.memory import selective_activation_bytes_per_layer as layer_with
from ckplan.model.ops import layer_ops
from ckplan.model.spec import SpecError


def _act(spec):
    return next(op for op in layer_ops(spec) if op.name == "expert_act")


def test_activation_input_in_fp8_by_hand(spec_of):
    """qwen3-30b-a3b at seq 4096, micro-batch 1: R = 4096 · 8 routed rows; the fused SwiGLU
    saves its input, the fc1 output 2 · 768 wide, and Megatron's routing probabilities."""
    rows, width = 4096 * 8, 2 * 768
    bf16 = spec_of("qwen3-30b-a3b", precision="fp8")
    fp8 = spec_of("qwen3-30b-a3b", precision="fp8", moe_act_input_fp8=True)
    assert _act(bf16).saved_bytes == 2 * rows * (width + 1)
    assert _act(fp8).saved_bytes == rows * width + 2 * rows
    # nothing else of the layer changes
    others = [(op.name, op.saved_bytes) for op in layer_ops(bf16) if op.name != "expert_act"]
    assert others == [(op.name, op.saved_bytes) for op in layer_ops(fp8) if op.name != "expert_act"]


def test_moe_act_keeps_the_fp8_input_and_drops_fc2s_copy(spec_of):
    """With moe_act the layer keeps the activation's FP8 input and drops fc2's saved input (its
    1-byte FP8 copy of the activation's output, R · 768 bytes)."""
    rows, width = 4096 * 8, 2 * 768
    fp8 = spec_of("qwen3-30b-a3b", precision="fp8", moe_act_input_fp8=True)
    whole = whole_layer(fp8)
    recomputed = layer_with(fp8, "moe_act")
    assert whole - recomputed == rows * 768
    bf16 = spec_of("qwen3-30b-a3b", precision="fp8")
    # against BF16 inputs the recomputed layer keeps (2 - 1) · R · 2F bytes less
    assert layer_with(bf16, "moe_act") - recomputed == rows * width


def test_key_rules(spec_of):
    with pytest.raises(SpecError, match="needs precision fp8"):
        spec_of("qwen3-30b-a3b", moe_act_input_fp8=True)
    with pytest.raises(SpecError, match="needs a mixture of experts"):
        spec_of("llama3-8b", precision="fp8", moe_act_input_fp8=True)
