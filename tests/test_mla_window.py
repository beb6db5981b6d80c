"""Multi-head latent attention and sliding-window attention: per-op bytes and FLOPs by hand."""

import pytest

from ckplan.model import flops, memory
from ckplan.model.layers import LayerKind
from ckplan.model.ops import layer_ops
from ckplan.model.spec import SpecError, spec_from_mapping

# h 64, a 4, q_lora 16, kv_lora 8, nope 8, rope 4, v 8; s 16, b 1 (T = 16), B = 2.
MLA = {
    "name": "small-mla",
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "seq": 16,
    "micro_batch": 1,
    "vocab": 0,
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention": "flash",
    "bias": False,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
}


def mla(**changes):
    return spec_from_mapping({**MLA, **changes})


def ops_of(spec, kind=None):
    return {op.name: op for op in layer_ops(spec, kind)}


def test_mla_saved_bytes_by_hand():
    """q_down saves x (T·h, shared with kv_down); q_norm and q_up the query latent (T·16);
    kv_norm and kv_up the KV latent (T·8); flash saves Q, K of a·(nope + rope) = 48 and V of
    a·v = 32, plus the fp32 logsumexp; out_proj the context a·v = 32."""
    ops = ops_of(mla())
    assert ops["q_down"].saved_bytes == 2 * 16 * 64
    assert ops["kv_down"].saved_bytes == 0
    assert ops["q_norm"].saved_bytes == ops["q_up"].saved_bytes == 2 * 16 * 16
    assert ops["kv_norm"].saved_bytes == ops["kv_up"].saved_bytes == 2 * 16 * 8
    assert ops["attention_core"].saved_bytes == 2 * 16 * (48 + 48 + 32) + 4 * 16 * 4
    assert ops["out_proj"].saved_bytes == 2 * 16 * 32
    assert "qkv_proj" not in ops


def test_mla_flops_by_hand():
    """Down h·16 and h·(8 + 4), up 16·a·12 and 8·a·(8 + 8); QKᵀ over 12 dims, AV over 8."""
    ops = ops_of(mla())
    assert ops["q_down"].forward_flops == 2 * 16 * 16 * 64
    assert ops["q_up"].forward_flops == 2 * 16 * 48 * 16
    assert ops["kv_down"].forward_flops == 2 * 16 * 12 * 64
    assert ops["kv_up"].forward_flops == 2 * 16 * 64 * 8
    assert ops["attention_core"].forward_flops == 2 * 16 * 16 * 12 * 4 + 2 * 16 * 16 * 8 * 4
    assert ops["out_proj"].forward_flops == 2 * 16 * 64 * 32


def test_mla_without_query_latent_and_tensor_parallel():
    """q_lora_rank 0 (DeepSeek-V2-Lite): Q projected from x. With t = 2 and sequence
    parallelism the down projections run on s/t tokens, the up projections on a/t heads."""
    ops = ops_of(mla(q_lora_rank=0))
    assert ops["q_proj"].saved_bytes == 2 * 16 * 64
    assert ops["q_proj"].forward_flops == 2 * 16 * 48 * 64
    ops = ops_of(mla(tp=2, sp=True))
    assert ops["q_down"].saved_bytes == 2 * 8 * 64
    assert ops["kv_down"].forward_flops == 2 * 8 * 12 * 64
    assert ops["kv_up"].forward_flops == 2 * 16 * 32 * 8
    assert ops["attention_core"].saved_bytes == 2 * 16 * 2 * 32 + 4 * 16 * 2


def test_mla_selective_keeps_q_k_v():
    spec = mla()
    full = memory.activation_bytes_per_layer(spec)
    selective = memory.selective_activation_bytes_per_layer(spec, "attention_core")
    assert full - selective == 4 * 16 * 4  # only the logsumexp: flash saves Q, K, V anyway
    for groups in (None, "attention_core"):
        memory.layer_backward_walk(spec, groups)
    memory.layer_backward_walk(mla(attention="standard", dropout=0.1), "attention_core")


def test_deepseek_v3_mla_parameters(spec_of):
    from ckplan.model.mla import mla_parameters

    split, whole = mla_parameters(spec_of("deepseek-v3"))
    assert split + whole == 187_107_328


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"v_head_dim": 0}, "needs v_head_dim > 0"),
        ({"kv_heads": 2}, "must equal heads"),
        ({"kv_lora_rank": 0}, "'q_lora_rank' needs multi-head latent attention"),
        ({"bias": True}, "no QKV bias"),
    ],
)
def test_mla_keys_are_validated(changes, message):
    with pytest.raises(SpecError, match=message):
        mla(**changes)


# ---- sliding window -------------------------------------------------------------------------

WINDOWED = LayerKind(window=4)


def test_flash_window_cuts_flops_not_bytes():
    """Flash attention with a window W < s: each query meets W keys, so QKᵀ and AV cost
    2·b·s·W·d·a each instead of 2·b·s²·d·a; what it saves is unchanged."""
    spec = mla(kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
               v_head_dim=0, sliding_window=4)  # fmt: skip
    full, windowed = ops_of(spec, LayerKind()), ops_of(spec, WINDOWED)
    d, a, s = 16, 4, 16
    assert full["attention_core"].forward_flops == 2 * 2 * s * s * d * a
    assert windowed["attention_core"].forward_flops == 2 * 2 * s * 4 * d * a
    assert windowed["attention_core"].saved_bytes == full["attention_core"].saved_bytes
    assert (
        windowed["attention_core"].backward_flops == 2 * 2 * 2 * s * 4 * d * a + 2 * s * 4 * d * a
    )


def test_standard_attention_window_changes_nothing():
    """Eager attention materialises every score and masks the window: same bytes, FLOPs."""
    spec = spec_from_mapping({**MLA, "kv_lora_rank": 0, "q_lora_rank": 0, "qk_nope_head_dim": 0,
                              "qk_rope_head_dim": 0, "v_head_dim": 0, "attention": "standard",
                              "sliding_window": 4})  # fmt: skip
    assert ops_of(spec, WINDOWED) == ops_of(spec, LayerKind())


def test_window_layers_and_a_window_at_least_the_sequence(spec_of):
    """Gemma 2: the even layers slide over 4096 tokens; at seq 4096 the window binds nowhere
    and the model is uniform again."""
    from ckplan.model.layers import layer_kinds

    gemma = spec_of("gemma2-9b")
    kinds = layer_kinds(gemma)
    assert [k.window for k in kinds[:4]] == [4096, 0, 4096, 0]
    assert len(set(layer_kinds(spec_of("gemma2-9b", seq=4096)))) == 1
    full = flops.layer_forward_flops(gemma, LayerKind())
    windowed = flops.layer_forward_flops(gemma, LayerKind(window=4096))
    core_full = flops.group_forward_flops(gemma, "attention_core", LayerKind())
    assert full - windowed == core_full // 2  # 4096 of 8192 keys per query
