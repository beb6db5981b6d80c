"""The bytes eager PyTorch's memory-bound kernels move (ckplan.hardware.code_path) against
torchtitan 9dec370's Llama block as validation/torchtitan_eager_bytes.py measures it."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from needs_torch import torch_or_skip

from ckplan.hardware.code_path import (
    eager_gated_act_bytes,
    eager_rmsnorm_bytes,
    eager_rope_bytes,
    spec_code_path,
    split_projection_sum_bytes,
)
from ckplan.inputs.gpus import load_gpu
from ckplan.model.ops import layer_ops

VALIDATION = Path(__file__).resolve().parent.parent / "validation"
SCRIPT = VALIDATION / "torchtitan_eager_bytes.py"
RESULTS = VALIDATION / "results-torchtitan-eager-bytes-torch-2.13.0.json"


def test_eager_bytes_per_element_by_hand():
    """bf16: RMSNorm 6 + 8 + 4 + 8 + 6 + 4 = 36 forward; backward 12 + 6 + 24 + 4 + 28 + 12 + 6
    and the residual add's 6 = 98. SwiGLU 4 + 6 forward, 6 + 6 + 6 backward. RoPE 6 + 8 + 6
    each way. fp32: the casts are no copies."""
    assert eager_rmsnorm_bytes(2) == (36, 98)
    assert eager_rmsnorm_bytes(4) == (28, 104)
    assert eager_gated_act_bytes(2) == (10, 18)
    assert eager_rope_bytes(2) == (20, 20)
    assert eager_rope_bytes(4) == (8, 8)
    assert split_projection_sum_bytes(3, 2) == 12
    assert split_projection_sum_bytes(1, 2) == 0


def _ckplan_bytes_per_token(spec_of, **changes):
    values = {"framework": "torchtitan", "kernels": "eager", "attention_kernel": "sdpa"}
    if changes.get("framework", "torchtitan") == "torchtitan":
        values["framework_version"] = "2024.12"  # 9dec370: K and V repeated before SDPA
    spec = spec_of("llama3-8b", **{**values, **changes})
    path = spec_code_path(spec, load_gpu("h100-sxm"))
    tokens = spec.seq * spec.micro_batch
    ops = {op.name: path._eager(op, spec.dtype_bytes) for op in layer_ops(spec)}
    return spec, ops, tokens


def test_eager_llama_layer_matches_the_measured_block(spec_of):
    """The eager code path's bytes per token of one Llama 3 8B layer, the attention kernel left
    out (timed as its own op, as the measurement leaves SDPA out), against the committed
    measurement of torchtitan's block: within 0.3 % forward and backward (what is left is the
    cos/sin table's broadcast read and the norms' per-token reductions)."""
    spec, ops, tokens = _ckplan_bytes_per_token(spec_of)
    measured = json.loads(RESULTS.read_text())["block_bytes_per_token"]
    forward = sum(v for k, v in measured.items() if k.startswith("forward/"))
    backward = sum(v for k, v in measured.items() if k.startswith("backward/"))
    kept = [op for name, op in ops.items() if name != "attention_core"]
    assert sum(op.forward_bytes for op in kept) / tokens == pytest.approx(forward, rel=3e-3)
    assert sum(op.backward_bytes for op in kept) / tokens == pytest.approx(backward, rel=3e-3)
    # a norm: 98 bytes per element backward against the fused kernel's 16
    assert ops["norm1"].backward_bytes == 98 * spec.hidden * tokens


def test_rope_counts_q_and_k_heads_under_gqa(spec_of):
    """RoPE rotates Q (a heads) and K (g heads), not two thirds of the QKV width: Llama 3 8B's
    32 + 8 of 48 heads."""
    spec, ops, tokens = _ckplan_bytes_per_token(spec_of)
    table = next(op for op in layer_ops(spec) if op.name == "qkv_proj")
    rope = ops["qkv_proj"].forward_bytes - table.forward_bytes
    assert rope == 20 * tokens * (32 + 8) * 128


def test_split_projection_sums_are_torchtitans_only(spec_of):
    """torchtitan's separate wq, wk, wv and w1, w3: the input gradients' sums (two adds and
    one); Hugging Face's eager path keeps the table's single gradient."""
    spec, ops, tokens = _ckplan_bytes_per_token(spec_of)
    table = {op.name: op for op in layer_ops(spec)}
    h = spec.hidden
    assert ops["fc1"].backward_bytes - table["fc1"].backward_bytes == 6 * tokens * h
    qkv_extra = ops["qkv_proj"].backward_bytes - table["qkv_proj"].backward_bytes
    assert qkv_extra == 12 * tokens * h + 20 * tokens * (32 + 8) * 128
    _, hf_ops, _ = _ckplan_bytes_per_token(spec_of, framework="hf")
    assert hf_ops["fc1"].backward_bytes == table["fc1"].backward_bytes


@pytest.fixture(scope="module")
def harness():
    torch_or_skip()
    spec = importlib.util.spec_from_file_location("torchtitan_eager_bytes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["torchtitan_eager_bytes"] = module
    spec.loader.exec_module(module)
    return module


def test_measured_small_block_matches_the_pure_functions(harness):
    """A small torchtitan block (h 64, 8 heads, 2 K/V heads, FFN 176) in bf16 on the CPU: each
    region's bytes per token, measured, against the per-element functions."""
    shape = harness.Shape(dim=64, heads=8, kv_heads=2, ffn=176)
    measured = harness.per_token(lambda s: harness.block_bytes(shape, 1, s), 16, 32)
    regions: dict[tuple[str, str], float] = {}
    for (phase, group, _), v in measured.items():
        key = (phase, group.split(" (")[0])
        regions[key] = regions.get(key, 0.0) + v
    h, f, qk = shape.dim, shape.ffn, (shape.heads + shape.kv_heads) * shape.head_dim
    norm_forward, norm_backward = eager_rmsnorm_bytes(2)
    # per-token reductions (mean, rsqrt, their gradients) ride on top: 1 % at h = 64
    assert regions[("forward", "rmsnorm")] == pytest.approx(2 * norm_forward * h, rel=0.02)
    assert regions[("backward", "rmsnorm")] == pytest.approx(2 * norm_backward * h, rel=0.02)
    assert regions[("forward", "swiglu")] == eager_gated_act_bytes(2)[0] * f
    assert regions[("backward", "swiglu")] == eager_gated_act_bytes(2)[1] * f
    # the complex64 cos/sin table rides on top, per token: its read by each product (Q's and
    # K's) and, backward, the copy of its conjugate for each (read and write)
    table = shape.head_dim // 2 * 8
    assert regions[("forward", "rope")] == eager_rope_bytes(2)[0] * qk + 2 * table
    assert regions[("backward", "rope")] == eager_rope_bytes(2)[1] * qk + 2 * table + 4 * table
    sums = split_projection_sum_bytes(3, 2) + split_projection_sum_bytes(2, 2)
    assert regions[("backward", "other")] == sums * h


def test_unfused_swiglu_table_keeps_its_eager_forward(spec_of):
    """A table built with `fused_swiglu: false` already counts eager's silu and product forward
    (5 bytes x B per element); the eager path raises only its backward, 8 -> 9 x B."""
    spec, ops, tokens = _ckplan_bytes_per_token(spec_of, fused_swiglu=False)
    table = next(op for op in layer_ops(spec) if op.name == "act")
    elements = tokens * spec.ffn_hidden
    assert ops["act"].forward_bytes == table.forward_bytes == 10 * elements
    assert ops["act"].backward_bytes == 18 * elements
    _, fused, _ = _ckplan_bytes_per_token(spec_of)
    assert fused["act"].forward_bytes == 10 * elements
    assert fused["act"].backward_bytes == 18 * elements
