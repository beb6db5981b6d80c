"""The small models the hand-computed tests share: h 64, a 4, s 32, b 2 (T = 64 tokens), B = 2,
RMSNorm, SwiGLU, flash attention, no bias and no vocabulary, so every byte and FLOP of a layer
is small enough to work out by hand in the test beside it."""

from __future__ import annotations

SMALL_LAYER = {
    "hidden": 64,
    "heads": 4,
    "seq": 32,
    "micro_batch": 2,
    "vocab": 0,
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention": "flash",
    "bias": False,
}

# Dense: a SwiGLU of 128; tp 2 with sequence parallelism and no communication overlap, so every
# gather is exposed.
SMALL_DENSE_TP2 = {
    "name": "small-dense",
    "layers": 2,
    **SMALL_LAYER,
    "ffn_hidden": 128,
    "tp": 2,
    "sp": True,
    "tp_comm_overlap": False,
}

# MoE: 4 experts of F_e 32, top-2, fused SwiGLU.
SMALL_MOE = {
    "name": "small-moe",
    "layers": 4,
    **SMALL_LAYER,
    "experts": 4,
    "top_k": 2,
    "moe_ffn_hidden": 32,
}

# presets/gpus/h100-sxm.yaml: NVLink 450e9 B/s at link_efficiency 0.7; NCCL's ring latency for
# 2 ranks, 8.4 us and 3.4 us a step (one step for a gather, two for an all-reduce).
H100_NVLINK_BANDWIDTH = 450e9 * 0.7
H100_GATHER_LATENCY_2_RANKS = 8.4e-6 + 3.4e-6
H100_ALL_REDUCE_LATENCY_2_RANKS = 8.4e-6 + 2 * 3.4e-6


def spec_from(base: dict, **changes):
    """`base` with `changes`, as a model description."""
    from ckplan.model.spec import spec_from_mapping

    return spec_from_mapping({**base, **changes})


def ops_by_name(spec) -> dict:
    """A dense layer's ops by name."""
    from ckplan.model.ops import layer_ops

    return {op.name: op for op in layer_ops(spec)}
