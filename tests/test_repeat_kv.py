"""K and V at the heads the attention kernel sees (ckplan.model.repeat_kv): torchtitan "2024.12"
repeats them to the query heads before SDPA (9dec370's `repeat_kv`), "0.3" passes enable_gqa.
Hand-computed on Llama 3 8B (32 heads, 8 K/V heads, head_dim 128) at seq 8192, micro-batch 2;
the CPU measurement is tests/test_torchtitan_repeat_kv.py."""

import pytest

from ckplan.inputs.presets import load_mapping, spec_from_values
from ckplan.model.memory import activation_bytes_by_op
from ckplan.model.ops import layer_ops
from ckplan.model.repeat_kv import kernel_kv_heads, repeat_kv_copy_bytes, repeats_kv

TOKENS = 8192 * 2  # s·b
D = 128
Q = 2 * TOKENS * 32 * D  # Q at 32 heads, bf16: 134,217,728
KV = 2 * TOKENS * 8 * D  # K or V at 8 heads: 33,554,432
LSE = 4 * TOKENS * 32  # fp32 logsumexp: 2,097,152


def _spec(**changes):
    base, origin = load_mapping("llama3-8b")
    values = {
        **base,
        "framework": "torchtitan",
        "framework_version": "2024.12",
        "seq": 8192,
        "micro_batch": 2,
    }
    return spec_from_values({**values, **changes}, origin)


def _op(spec, name):
    return next(op for op in layer_ops(spec) if op.name == name)


def test_which_releases_repeat():
    assert repeats_kv("torchtitan", "2024.12")
    assert not repeats_kv("torchtitan", "0.3")
    assert not repeats_kv("megatron", None)
    assert not repeats_kv("hf", "5.25")


def test_kernel_heads():
    assert kernel_kv_heads(True, 32, 8) == 32
    assert kernel_kv_heads(False, 32, 8) == 8


def test_copy_bytes_llama3_8b():
    # K and V: read 8 heads, write 32, 256 values per token and head, 2 bytes
    assert repeat_kv_copy_bytes(TOKENS, 32, 8, 2 * D, 2) == 2 * TOKENS * 40 * 256 == 335_544_320
    assert repeat_kv_copy_bytes(TOKENS, 32, 32, 2 * D, 2) == 0  # repeat_kv returns its input


def test_saved_by_the_kernel_at_the_query_heads():
    dec_2024 = activation_bytes_by_op(_spec())["attention_core"]
    v0_3 = activation_bytes_by_op(_spec(framework_version="0.3"))["attention_core"]
    assert v0_3 == Q + 2 * KV + LSE == 203_423_744
    assert dec_2024 == 3 * Q + LSE == 404_750_336
    assert dec_2024 - v0_3 == 2 * 2 * TOKENS * (32 - 8) * D


def test_tensor_parallel_ranks_repeat_their_own_heads():
    # tp 8: 4 query heads and 1 K/V head per rank, K and V repeated to 4
    spec = _spec(tp=8)
    q_rank = 2 * TOKENS * 4 * D
    assert activation_bytes_by_op(spec)["attention_core"] == 3 * q_rank + 4 * TOKENS * 4
    copy = 2 * TOKENS * (4 + 1) * 2 * D
    assert _op(spec, "qkv_proj").forward_bytes == copy
    assert _op(_spec(tp=8, framework_version="0.3"), "qkv_proj").forward_bytes == 0


def test_kernel_reads_and_the_copy_traffic():
    dec_2024, v0_3 = _spec(), _spec(framework_version="0.3")
    core, core_03 = _op(dec_2024, "attention_core"), _op(v0_3, "attention_core")
    # the kernel reads K and V at 32 heads forward, reads them and writes dK, dV backward
    assert core.forward_bytes - core_03.forward_bytes == 2 * 2 * TOKENS * 24 * D
    assert core.backward_bytes - core_03.backward_bytes == 2 * 2 * 2 * TOKENS * 24 * D
    # the backward transient is the same: dK, dV at 32 heads before the sum to 8
    assert core.grad_workspace_bytes == core_03.grad_workspace_bytes
    assert core.input_grad_bytes == core_03.input_grad_bytes == Q + 2 * KV
    qkv, qkv_03 = _op(dec_2024, "qkv_proj"), _op(v0_3, "qkv_proj")
    assert (qkv.forward_bytes, qkv.backward_bytes) == (335_544_320, 335_544_320)
    assert (qkv_03.forward_bytes, qkv_03.backward_bytes) == (0, 0)


@pytest.mark.parametrize("changes", [{"kv_heads": 32}, {"framework": "megatron"}])
def test_nothing_repeated(changes):
    if changes.get("framework") == "megatron":
        changes["framework_version"] = None
    spec = _spec(**changes)
    heads_kv = spec.kv_heads
    assert activation_bytes_by_op(spec)["attention_core"] == Q + 2 * 2 * TOKENS * heads_kv * D + LSE
    assert _op(spec, "qkv_proj").forward_bytes == 0
